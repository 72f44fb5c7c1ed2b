"""Pieces shared by the pool's pod templates: security, probes, scheduling."""

from __future__ import annotations

from typing import Any

from kvpool.operator.models import Resources, Toleration

RUN_AS_USER = 1000
POD_IP_ENV = "POD_IP"
TMP_VOLUME = "tmp"

POD_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": RUN_AS_USER,
    "runAsGroup": RUN_AS_USER,
    "fsGroup": RUN_AS_USER,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def container_security_context(add_capabilities: list[str] | None = None) -> dict[str, Any]:
    """Non-root, read-only root filesystem, no privilege escalation, capabilities dropped."""
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if add_capabilities:
        capabilities["add"] = list(add_capabilities)
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": capabilities,
    }


def pod_ip_env() -> dict[str, Any]:
    """``POD_IP`` from the downward API (args may refer to it as ``$(POD_IP)``)."""
    return {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def tmp_volume() -> tuple[dict[str, Any], dict[str, Any]]:
    """A writable ``/tmp`` (logs) for a read-only root filesystem: (volume, mount)."""
    return {"name": TMP_VOLUME, "emptyDir": {}}, {"name": TMP_VOLUME, "mountPath": "/tmp"}


def resources(spec: Resources) -> dict[str, Any]:
    """A container's ``resources`` (only the parts that are set)."""
    return {
        key: dict(value) for key, value in (("limits", spec.limits), ("requests", spec.requests)) if value
    }


def tolerations(items: list[Toleration]) -> list[dict[str, Any]]:
    return [t.model_dump(by_alias=True, exclude_none=True) for t in items]


def scheduling(node_selector: dict[str, str], items: list[Toleration]) -> dict[str, Any]:
    """``nodeSelector`` and ``tolerations`` of a pod spec, when set."""
    out: dict[str, Any] = {}
    if node_selector:
        out["nodeSelector"] = dict(node_selector)
    if items:
        out["tolerations"] = tolerations(items)
    return out
