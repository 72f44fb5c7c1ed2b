"""The Kubernetes API: a small JSON client over ``kubernetes_asyncio``, and apply.

Objects stay plain dicts; updates are JSON merge patches. One configuration (in-cluster
or kubeconfig) serves both this client and kopf's own login.

Apply brings a child to its desired state, writing only when it differs, compared field by
field on what the operator sets (server defaults and others' fields do not count; values
the operator owns whole, such as selectors, a Deployment's strategy and NetworkPolicy rules,
count entirely). A hand
edit of an owned field (``kubectl scale``, an edited policy) is put back; a new operator
release whose rendering differs only where the server already holds the same value writes
nothing. Each child also carries the JSON it was last applied with (an annotation), which
says which fields the operator stopped setting: a patch sets the desired state and removes
those (the ``kubectl apply`` way), leaving others' fields alone.

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
import yaml
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config import ConfigException, load_incluster_config, load_kube_config

from kvpool.connector.contract.version import package_version
from kvpool.operator.merge_patch import canonical_json, overlay
from kvpool.operator.names import ANNOTATION_LAST_APPLIED, ApiResource, api_resource_of
from kvpool.operator.spec import parse_quantity

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
        self, resource: ApiResource, namespace: str | None, label_selector: str | None = None
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


class KubeconfigError(Exception):
    """No credentials could be loaded; the message names the file and where it was named."""


async def load_configuration(kubeconfig: str | None = None) -> Configuration:
    """In-cluster credentials, else the kubeconfig (``kubeconfig``, ``$KUBECONFIG``, default)."""
    configuration = Configuration()
    if kubeconfig is None:
        try:
            load_incluster_config(client_configuration=configuration)
            return configuration
        except ConfigException:
            pass
    if kubeconfig:
        source, path = "--kubeconfig", kubeconfig
    elif os.environ.get("KUBECONFIG"):
        source, path = "$KUBECONFIG", os.environ["KUBECONFIG"]
    else:
        source, path = "not in a cluster; the default kubeconfig", "~/.kube/config"
    try:
        await load_kube_config(config_file=os.path.expanduser(path), client_configuration=configuration)
    except (ConfigException, OSError, ValueError, yaml.YAMLError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise KubeconfigError(f"{source} {path}: no credentials from it: {reason}") from None
    return configuration


async def connection_info(configuration: Configuration) -> kopf.ConnectionInfo:
    """The same credentials, for kopf."""
    header: Any = configuration.get_api_key_with_prefix("BearerToken")
    if inspect.isawaitable(header):
        header = await header
    scheme, token = None, None
    if header:
        parts = str(header).split(" ", 1)
        scheme, token = (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0])
    return kopf.ConnectionInfo(
        server=configuration.host,  # type: ignore[arg-type]  # set by either loader
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


# Values the operator owns as a whole: a key someone adds there changes what they select or
# carry, so it is drift too (elsewhere a key the operator does not set is someone else's, or
# a server default, and is left alone). A Deployment's ``strategy`` is one: a ``rollingUpdate``
# left beside ``type: Recreate`` (a hand edit's, the server's default for it) is invalid, so
# the patch that puts ``Recreate`` back must remove it (a real server refuses it otherwise).
WHOLE_VALUES = frozenset(
    {
        "matchLabels",
        "strategy",
        "matchExpressions",
        "nodeSelector",
        "selector",
        "podSelector",
        "namespaceSelector",
        "data",
    }
)
# Kinds whose whole spec is the operator's (inside it the server adds only ``protocol``).
WHOLE_SPEC_KINDS = frozenset({"NetworkPolicy", "PodDisruptionBudget"})
SERVER_DEFAULTED = frozenset({"protocol"})
# Keys whose values are Kubernetes quantities: "0.5" and "500m" are the same request.
QUANTITY_PARENTS = frozenset({"limits", "requests"})


def _same_quantity(live: Any, desired: Any) -> bool:
    try:
        return parse_quantity(live) == parse_quantity(desired)
    except (ValueError, TypeError):
        return live == desired


def drift(
    live: Any, desired: Any, path: str = "", whole: bool = False, quantities: bool = False
) -> list[str]:
    """Where ``live`` differs from ``desired`` on what the operator sets (field paths).

    Every value the operator sets must be there as set (lists: the same length, each item
    compared the same way); keys it does not set are someone else's or the server's defaults
    and count only inside a value the operator owns ``whole`` (selectors, a ConfigMap's data,
    NetworkPolicy rules), where only ``protocol`` may be added by the server.
    """
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return [path or "."]
        out = []
        for key, value in desired.items():
            if key not in live:
                out.append(f"{path}.{key}".lstrip("."))
                continue
            whole_key = whole or key in WHOLE_VALUES
            out += drift(
                live[key],
                value,
                f"{path}.{key}".lstrip("."),
                whole_key,
                quantities or key in QUANTITY_PARENTS,
            )
        if whole:
            out += [
                f"{path}.{key}".lstrip(".")
                for key in live
                if key not in desired and key not in SERVER_DEFAULTED
            ]
        return out
    if isinstance(desired, list):
        if not isinstance(live, list) or len(live) != len(desired):
            return [path]
        out = []
        for index, (live_item, desired_item) in enumerate(zip(live, desired)):
            out += drift(live_item, desired_item, f"{path}[{index}]", whole)
        return out
    if quantities:
        return [] if _same_quantity(live, desired) else [path]
    return [] if live == desired else [path]


def owned_fields(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What apply compares of a child: everything but the server's metadata, and of the
    metadata only the labels (ownership is checked on its own)."""
    out = {
        key: value for key, value in obj.items() if key not in ("metadata", "status", "apiVersion", "kind")
    }
    labels = (obj.get("metadata") or {}).get("labels")
    if labels:
        out["metadata"] = {"labels": labels}
    return out


def _whole_spec(desired: Mapping[str, Any]) -> bool:
    return desired.get("kind") in WHOLE_SPEC_KINDS


def leftovers(previous: Mapping[str, Any], desired: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    """Keys the operator set before (its last-applied record) and no longer sets, still live."""
    out = []
    for key, value in previous.items():
        if key not in live:
            continue
        if key not in desired:
            out.append(key)
        elif (
            isinstance(value, Mapping)
            and isinstance(desired[key], Mapping)
            and isinstance(live[key], Mapping)
        ):
            out += [f"{key}.{sub}" for sub in leftovers(value, desired[key], live[key])]
    return out


def changed_fields(live: Mapping[str, Any], desired: Mapping[str, Any]) -> list[str]:
    """The owned fields where ``live`` is not as ``desired`` (empty: nothing to write)."""
    _, previous = last_applied(live)
    live_fields, desired_fields = owned_fields(live), owned_fields(desired)
    if _whole_spec(desired):
        found = drift(live_fields.get("spec"), desired_fields.pop("spec", None), "spec", whole=True)
    else:
        found = []
    found += drift(live_fields, desired_fields)
    return found + leftovers(owned_fields(previous), owned_fields(desired), live_fields)


def desired_patch(live: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch from ``live`` to ``desired``; empty when every owned field is as desired.

    Compared field by field on what the operator sets (``drift``), never on the record as a
    whole: a release whose record differs (a new field the server already defaults the same
    way) writes nothing. The record still says which fields the operator stopped setting.
    """
    if not changed_fields(live, desired):
        return {}
    _, previous = last_applied(live)
    desired, _ = with_last_applied(desired)
    patch = overlay(previous, desired)
    _clear_foreign(patch, live, desired)
    if _whole_spec(desired) and isinstance(patch.get("spec"), dict):
        _clear_foreign(patch["spec"], live.get("spec"), desired.get("spec"), whole=True)
    return patch


def _clear_foreign(patch: dict[str, Any], live: Any, desired: Any, whole: bool = False) -> None:
    """In maps the operator owns whole, a merge patch must also remove the keys someone added."""
    if not isinstance(live, Mapping) or not isinstance(desired, Mapping):
        return
    for key, value in desired.items():
        sub = patch.get(key)
        if isinstance(sub, dict):
            _clear_foreign(sub, live.get(key), value, whole or key in WHOLE_VALUES)
    if whole:
        for key in live:
            if key not in desired and key not in SERVER_DEFAULTED:
                patch[key] = None


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
    # The owned fields a patch put right (empty when nothing was written, or on create).
    changed: tuple[str, ...] = ()
    # Whether they were changed by someone else (the record says the operator set them as desired).
    edited: bool = False


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
    changed = changed_fields(live, obj)
    if not changed:
        return Applied(live)
    patch = desired_patch(live, obj)
    patch.setdefault("metadata", {}).update(preconditions(live))
    raw, _ = last_applied(live)
    edited = raw == with_last_applied(obj)[1]
    return Applied(await kube.patch(resource, namespace, name, patch), changed=tuple(changed), edited=edited)


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
