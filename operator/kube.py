"""A small JSON client for the Kubernetes API over ``kubernetes_asyncio``'s ApiClient.

Objects stay plain dicts; updates are JSON merge patches. One configuration (in-cluster
or kubeconfig) serves both this client and kopf's own login.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import kopf
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config import ConfigException, load_incluster_config, load_kube_config

from kvpool.operator.resources import Resource

MERGE_PATCH = "application/merge-patch+json"
USER_AGENT = "kvpool-operator/0.1"


class ApiError(Exception):
    """A failed API request: HTTP status (0 when there was no response) and reason."""

    def __init__(self, status: int, reason: str, message: str = ""):
        self.status = status
        self.reason = reason
        super().__init__(f"{status} {reason}: {message}" if message else f"{status} {reason}")

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @classmethod
    def from_exception(cls, exc: ApiException) -> ApiError:
        message = ""
        try:
            message = json.loads(exc.body or "{}").get("message", "")
        except (TypeError, ValueError, AttributeError):
            message = str(exc.body or "")[:200]
        return cls(int(exc.status or 0), str(exc.reason or ""), message)


WriteHook = Callable[[str, Resource], None]


class Kube:
    """GET/LIST/POST/PATCH/DELETE of JSON objects; ``None`` for objects that do not exist."""

    def __init__(self, client: ApiClient, on_write: WriteHook | None = None, timeout: float = 30.0):
        self._client = client
        self._on_write = on_write
        self._timeout = timeout

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str | None = None,
    ) -> Any:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        try:
            return await self._client.call_api(
                path,
                method,
                query_params=query or [],
                header_params=headers,
                body=body,
                response_types_map={200: "object", 201: "object", 202: "object"},
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
                _preload_content=True,
                _request_timeout=self._timeout,
            )
        except ApiException as exc:
            raise ApiError.from_exception(exc) from None

    def _wrote(self, verb: str, resource: Resource) -> None:
        if self._on_write is not None:
            self._on_write(verb, resource)

    async def get(self, resource: Resource, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._call("GET", resource.path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(
        self, resource: Resource, namespace: str, label_selector: str | None = None
    ) -> list[dict[str, Any]]:
        query = [("labelSelector", label_selector)] if label_selector else None
        result = await self._call("GET", resource.path(namespace), query=query)
        return list((result or {}).get("items") or [])

    async def create(self, resource: Resource, namespace: str, obj: Mapping[str, Any]) -> dict[str, Any]:
        self._wrote("create", resource)
        return await self._call(
            "POST", resource.path(namespace), body=dict(obj), content_type="application/json"
        )

    async def patch(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any]:
        self._wrote("patch", resource)
        return await self._call(
            "PATCH", resource.path(namespace, name, subresource), body=dict(patch), content_type=MERGE_PATCH
        )

    async def delete(self, resource: Resource, namespace: str, name: str) -> bool:
        """Delete; ``False`` when it was already gone."""
        self._wrote("delete", resource)
        try:
            await self._call("DELETE", resource.path(namespace, name), content_type="application/json")
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True


async def load_configuration(kubeconfig: str | None = None) -> Configuration:
    """In-cluster credentials, else the kubeconfig (``kubeconfig``, ``$KUBECONFIG``, default)."""
    configuration = Configuration()
    if kubeconfig is None:
        try:
            load_incluster_config(client_configuration=configuration)
            return configuration
        except ConfigException:
            pass
    path = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
    await load_kube_config(config_file=os.path.expanduser(path), client_configuration=configuration)
    return configuration


async def connection_info(configuration: Configuration) -> kopf.ConnectionInfo:
    """The same credentials, for kopf."""
    header = configuration.get_api_key_with_prefix("BearerToken")
    if inspect.isawaitable(header):
        header = await header
    scheme, token = None, None
    if header:
        parts = str(header).split(" ", 1)
        scheme, token = (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0])
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        username=configuration.username or None,
        password=configuration.password or None,
        scheme=scheme,
        token=token,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
        proxy_url=configuration.proxy,
    )
