"""The Kubernetes API: a small JSON client over ``kubernetes_asyncio``, and apply.

Objects stay plain dicts; updates are JSON merge patches. One configuration (in-cluster
or kubeconfig) serves both this client and kopf's own login.

Apply brings a child to its desired state, writing only when it differs: each child
carries the JSON it was last applied with (an annotation). Equal JSON means no write;
otherwise a merge patch sets the desired state and removes the fields the operator
stopped setting (the ``kubectl apply`` way), leaving others' fields alone.

Apply touches only what the pool owns: an object that exists without the pool's
ownerReference (its UID) is never patched or deleted; it is reported instead. Every
patch and delete carries the live object's ``uid`` and ``resourceVersion``, so one that
changed (or was replaced) since it was read is refused (409), never overwritten.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import kopf
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config import ConfigException, load_incluster_config, load_kube_config

from kvpool.connector.contract.version import package_version
from kvpool.operator.merge_patch import canonical_json, overlay
from kvpool.operator.names import ANNOTATION_LAST_APPLIED, ApiResource, api_resource_of

MERGE_PATCH = "application/merge-patch+json"
USER_AGENT = f"kvpool-operator/{package_version()}"


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


WriteHook = Callable[[str, ApiResource], None]


class KubeClient:
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

    def _wrote(self, verb: str, resource: ApiResource) -> None:
        if self._on_write is not None:
            self._on_write(verb, resource)

    async def get(self, resource: ApiResource, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._call("GET", resource.path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(
        self, resource: ApiResource, namespace: str, label_selector: str | None = None
    ) -> list[dict[str, Any]]:
        query = [("labelSelector", label_selector)] if label_selector else None
        result = await self._call("GET", resource.path(namespace), query=query)
        return list((result or {}).get("items") or [])

    async def create(self, resource: ApiResource, namespace: str, obj: Mapping[str, Any]) -> dict[str, Any]:
        self._wrote("create", resource)
        return await self._call(
            "POST", resource.path(namespace), body=dict(obj), content_type="application/json"
        )

    async def patch(
        self,
        resource: ApiResource,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any]:
        self._wrote("patch", resource)
        return await self._call(
            "PATCH", resource.path(namespace, name, subresource), body=dict(patch), content_type=MERGE_PATCH
        )

    async def delete(
        self,
        resource: ApiResource,
        namespace: str,
        name: str,
        preconditions: Mapping[str, str] | None = None,
    ) -> bool:
        """Delete (only the object ``preconditions`` describe); ``False`` when it was already gone."""
        self._wrote("delete", resource)
        body = None
        if preconditions:
            body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": dict(preconditions)}
        try:
            await self._call(
                "DELETE", resource.path(namespace, name), body=body, content_type="application/json"
            )
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


# Apply: the last-applied annotation and the patches it leads to.


def with_last_applied(obj: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """``obj`` annotated with its own canonical JSON, and that JSON."""
    desired = copy.deepcopy(dict(obj))
    annotations = desired.setdefault("metadata", {}).setdefault("annotations", {})
    annotations.pop(ANNOTATION_LAST_APPLIED, None)
    applied = canonical_json(desired)
    annotations[ANNOTATION_LAST_APPLIED] = applied
    return desired, applied


def last_applied(live: Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """The annotation on a live object, raw and parsed (``{}`` when absent or broken)."""
    raw = (live.get("metadata", {}).get("annotations") or {}).get(ANNOTATION_LAST_APPLIED)
    try:
        parsed = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        parsed = {}
    return raw, parsed if isinstance(parsed, dict) else {}


def desired_patch(live: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch from ``live`` to ``desired``; empty when already applied."""
    desired, applied = with_last_applied(desired)
    raw, previous = last_applied(live)
    if raw == applied:
        return {}
    return overlay(previous, desired)


def describe(obj: Mapping[str, Any]) -> str:
    """``Kind namespace/name``."""
    meta = obj.get("metadata", {})
    return f"{obj.get('kind', 'object')} {meta.get('namespace', '')}/{meta.get('name', '')}"


def owned_by(live: Mapping[str, Any], owner_uid: str) -> bool:
    """Whether ``live`` carries an ownerReference to the object with ``owner_uid``."""
    references = live.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == owner_uid for ref in references)


def not_owned(live: Mapping[str, Any]) -> str:
    """The refusal for an object the pool does not own."""
    return f"{describe(live)} exists and is not this pool's (no ownerReference to it) [ownership]"


def preconditions(live: Mapping[str, Any]) -> dict[str, str]:
    """The live object's identity and version: a write applies to it, or fails with 409."""
    meta = live.get("metadata", {})
    return {key: meta[key] for key in ("uid", "resourceVersion") if meta.get(key)}


@dataclass(frozen=True)
class Applied:
    """An apply's outcome: the live object, or why the pool left it alone."""

    live: dict[str, Any] | None
    conflict: str | None = None


async def ensure(kube: KubeClient, obj: Mapping[str, Any], owner_uid: str) -> Applied:
    """Create ``obj``, or patch it if the owner ``owner_uid`` owns it; never touch it otherwise."""
    resource = api_resource_of(dict(obj))
    namespace, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    live = await kube.get(resource, namespace, name)
    if live is None:
        desired, _ = with_last_applied(obj)
        try:
            return Applied(await kube.create(resource, namespace, desired))
        except ApiError as exc:
            if not exc.conflict:
                raise
            live = await kube.get(resource, namespace, name)
            if live is None:
                raise
    if not owned_by(live, owner_uid):
        return Applied(None, not_owned(live))
    patch = desired_patch(live, obj)
    if not patch:
        return Applied(live)
    patch.setdefault("metadata", {}).update(preconditions(live))
    return Applied(await kube.patch(resource, namespace, name, patch))


async def ensure_absent(
    kube: KubeClient, resource: ApiResource, namespace: str, name: str, owner_uid: str
) -> Applied:
    """Delete the object if the owner ``owner_uid`` owns it (``live``: what was deleted).

    An object of that name the owner does not own is left alone (``conflict`` says so).
    """
    live = await kube.get(resource, namespace, name)
    if live is None:
        return Applied(None)
    if not owned_by(live, owner_uid):
        return Applied(None, not_owned(live))
    deleted = await kube.delete(resource, namespace, name, preconditions(live))
    return Applied(live if deleted else None)
