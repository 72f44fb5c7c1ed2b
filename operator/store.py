"""Standalone store pods: ``mooncake_client`` processes that own the pool's memory."""

from __future__ import annotations

from typing import Any

from kvpool.operator import names, pods
from kvpool.operator.models import PoolSpec
from kvpool.operator.quantity import format_bytes, parse_quantity

CONTAINER = "store"
# Memory a store pod needs beyond its segment (process, transfer buffers).
MEMORY_OVERHEAD = 512 << 20


def memory_limit(spec: PoolSpec) -> int | None:
    """The store container's memory limit in bytes, if the spec sets one."""
    value = spec.store.resources.limits.get("memory")
    return None if value is None else int(parse_quantity(value))


def store_resources(spec: PoolSpec) -> dict[str, Any]:
    """The store container's resources; without a memory limit, one that holds the segment."""
    out = pods.resources(spec.store.resources)
    if memory_limit(spec) is None:
        memory = format_bytes(spec.store.segment_size + MEMORY_OVERHEAD)
        out.setdefault("limits", {})["memory"] = memory
        out.setdefault("requests", {}).setdefault("memory", memory)
    return out


def store_args(spec: PoolSpec, master_address: str, metadata_server: str) -> list[str]:
    """``mooncake_client`` flags for the spec."""
    store = spec.store
    args = [
        f"--master_server_address={master_address}",
        f"--metadata_server={metadata_server}",
        f"--protocol={store.protocol}",
        f"--global_segment_size={store.segment_size}",
        f"--host=$({pods.POD_IP_ENV})",
        f"--port={store.port}",
    ]
    if store.rdma_devices:
        args.append("--device_names=" + ",".join(store.rdma_devices))
    return args + list(store.extra_args)


def store_deployment(
    pool: str, namespace: str, spec: PoolSpec, master_address: str, metadata_server: str
) -> dict[str, Any]:
    """The store Deployment (standalone mode)."""
    store = spec.store
    tmp_volume, tmp_mount = pods.tmp_volume()
    capabilities = ["IPC_LOCK"] if store.protocol == "rdma" else None
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["mooncake_client"],
        "args": store_args(spec, master_address, metadata_server),
        "env": [pods.pod_ip_env()],
        "ports": [{"name": "store", "containerPort": store.port, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": "store"}, "periodSeconds": 5},
        "livenessProbe": {
            "tcpSocket": {"port": "store"},
            "initialDelaySeconds": 15,
            "periodSeconds": 10,
        },
        "resources": store_resources(spec),
        "securityContext": pods.container_security_context(capabilities),
        "volumeMounts": [tmp_mount],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": names.store_name(pool),
            "namespace": namespace,
            "labels": names.labels(pool, names.STORE),
        },
        "spec": {
            "replicas": store.replicas,
            "selector": {"matchLabels": names.selector(pool, names.STORE)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": names.labels(pool, names.STORE)},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": dict(pods.POD_SECURITY_CONTEXT),
                    "containers": [container],
                    "volumes": [tmp_volume],
                    **pods.scheduling(store.node_selector, store.tolerations),
                },
            },
        },
    }
