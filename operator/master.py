"""The Mooncake master: its Deployment, its Service and the address clients use."""

from __future__ import annotations

from typing import Any

from kvpool.operator import names, pods
from kvpool.operator.models import PoolSpec

CONTAINER = "master"
HEALTH_PATH = "/health"


def master_address(pool: str, namespace: str, spec: PoolSpec) -> str:
    """What clients put in ``master_server_address``: the Service, or etcd when HA."""
    if spec.master.ha.enabled:
        return "etcd://" + ";".join(spec.master.ha.etcd_endpoints)
    return f"{names.master_name(pool)}.{namespace}.svc:{spec.master.rpc_port}"


def master_args(spec: PoolSpec) -> list[str]:
    """``mooncake_master`` flags for the spec."""
    master = spec.master
    args = [
        f"--rpc_port={master.rpc_port}",
        f"--metrics_port={master.metrics_port}",
        f"--eviction_high_watermark_ratio={master.eviction_high_watermark_ratio}",
        f"--eviction_ratio={master.eviction_ratio}",
        f"--default_kv_lease_ttl={master.lease_ttl_ms}",
    ]
    if master.ha.enabled:
        args += [
            "--enable_ha=true",
            "--ha_backend_type=etcd",
            "--etcd_endpoints=" + ";".join(master.ha.etcd_endpoints),
            f"--rpc_address=$({pods.POD_IP_ENV})",
        ]
    return args + list(master.extra_args)


def master_deployment(pool: str, namespace: str, spec: PoolSpec) -> dict[str, Any]:
    """The master Deployment: Recreate when single, rolling when HA."""
    master = spec.master
    tmp_volume, tmp_mount = pods.tmp_volume()
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["mooncake_master"],
        "args": master_args(spec),
        "env": [pods.pod_ip_env()],
        "ports": [
            {"name": "rpc", "containerPort": master.rpc_port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": master.metrics_port, "protocol": "TCP"},
        ],
        "readinessProbe": {"tcpSocket": {"port": "rpc"}, "periodSeconds": 5},
        "livenessProbe": {
            "httpGet": {"path": HEALTH_PATH, "port": "metrics"},
            "initialDelaySeconds": 10,
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "securityContext": pods.container_security_context(),
        "volumeMounts": [tmp_mount],
    }
    if res := pods.resources(master.resources):
        container["resources"] = res
    strategy: dict[str, Any] = (
        {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
        if master.ha.enabled
        else {"type": "Recreate"}
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": names.master_name(pool),
            "namespace": namespace,
            "labels": names.labels(pool, names.MASTER),
        },
        "spec": {
            "replicas": master.replicas,
            "selector": {"matchLabels": names.selector(pool, names.MASTER)},
            "strategy": strategy,
            "template": {
                "metadata": {"labels": names.labels(pool, names.MASTER)},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": dict(pods.POD_SECURITY_CONTEXT),
                    "containers": [container],
                    "volumes": [tmp_volume],
                    **pods.scheduling(master.node_selector, master.tolerations),
                },
            },
        },
    }


def master_service(pool: str, namespace: str, spec: PoolSpec) -> dict[str, Any]:
    """The master Service: RPC and metrics/health."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": names.master_name(pool),
            "namespace": namespace,
            "labels": names.labels(pool, names.MASTER),
        },
        "spec": {
            "type": "ClusterIP",
            "selector": names.selector(pool, names.MASTER),
            "ports": [
                {"name": "rpc", "port": spec.master.rpc_port, "targetPort": "rpc", "protocol": "TCP"},
                {
                    "name": "metrics",
                    "port": spec.master.metrics_port,
                    "targetPort": "metrics",
                    "protocol": "TCP",
                },
            ],
        },
    }
