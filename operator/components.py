"""The pool's Mooncake components: master and store Deployments (one pod builder), the master
Service, and the NetworkPolicy around them. Pure: a spec in, manifests out.
"""

from __future__ import annotations

from typing import Any

from kvpool.operator import names
from kvpool.operator.spec import ComputeResources, PoolSpec, Toleration, format_bytes, parse_quantity

RUN_AS_USER = 1000
POD_IP_ENV = "POD_IP"
TMP_VOLUME = "tmp"
MASTER_HEALTH_PATH = "/health"
# Memory a store pod needs beyond its segment (process, transfer buffers).
STORE_MEMORY_OVERHEAD = 512 << 20

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


def container_resources(spec: ComputeResources) -> dict[str, Any]:
    """A container's ``resources`` (only the parts that are set)."""
    return {
        key: dict(value) for key, value in (("limits", spec.limits), ("requests", spec.requests)) if value
    }


def scheduling(node_selector: dict[str, str], tolerations: list[Toleration]) -> dict[str, Any]:
    """``nodeSelector`` and ``tolerations`` of a pod spec, when set."""
    out: dict[str, Any] = {}
    if node_selector:
        out["nodeSelector"] = dict(node_selector)
    if tolerations:
        out["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in tolerations]
    return out


def component_deployment(
    pool: str,
    namespace: str,
    spec: PoolSpec,
    component: str,
    container: dict[str, Any],
    *,
    replicas: int,
    strategy: dict[str, Any],
    pod_scheduling: dict[str, Any],
    add_capabilities: list[str] | None = None,
) -> dict[str, Any]:
    """A Deployment of one hardened container named ``component``, running the pool's image.

    ``container`` holds what differs between components (command, args, ports, probes,
    resources); image, ``POD_IP``, security contexts and a writable ``/tmp`` are shared.
    """
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": names.child_metadata(pool, namespace, names.component_name(pool, component), component),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": names.selector(pool, component)},
            "strategy": strategy,
            "template": {
                "metadata": {"labels": names.labels(pool, component)},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": dict(POD_SECURITY_CONTEXT),
                    "containers": [
                        {
                            "name": component,
                            "image": spec.image,
                            "imagePullPolicy": spec.image_pull_policy,
                            **container,
                            "env": [pod_ip_env()],
                            "securityContext": container_security_context(add_capabilities),
                            "volumeMounts": [{"name": TMP_VOLUME, "mountPath": "/tmp"}],
                        }
                    ],
                    # A writable /tmp (logs) beside the read-only root filesystem.
                    "volumes": [{"name": TMP_VOLUME, "emptyDir": {}}],
                    **pod_scheduling,
                },
            },
        },
    }


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
            f"--rpc_address=$({POD_IP_ENV})",
        ]
    return args + list(master.extra_args)


def master_deployment(pool: str, namespace: str, spec: PoolSpec) -> dict[str, Any]:
    """The master Deployment: Recreate when single, rolling when HA."""
    master = spec.master
    container: dict[str, Any] = {
        "command": ["mooncake_master"],
        "args": master_args(spec),
        "ports": [
            {"name": "rpc", "containerPort": master.rpc_port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": master.metrics_port, "protocol": "TCP"},
        ],
        "readinessProbe": {"tcpSocket": {"port": "rpc"}, "periodSeconds": 5},
        "livenessProbe": {
            "httpGet": {"path": MASTER_HEALTH_PATH, "port": "metrics"},
            "initialDelaySeconds": 10,
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
    }
    if resources := container_resources(master.resources):
        container["resources"] = resources
    strategy: dict[str, Any] = (
        {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
        if master.ha.enabled
        else {"type": "Recreate"}
    )
    return component_deployment(
        pool,
        namespace,
        spec,
        names.MASTER,
        container,
        replicas=master.replicas,
        strategy=strategy,
        pod_scheduling=scheduling(master.node_selector, master.tolerations),
    )


def master_service(pool: str, namespace: str, spec: PoolSpec) -> dict[str, Any]:
    """The master Service: RPC and metrics/health."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": names.child_metadata(pool, namespace, names.master_name(pool), names.MASTER),
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


def store_memory_limit(spec: PoolSpec) -> int | None:
    """The store container's memory limit in bytes, if the spec sets one."""
    value = spec.store.resources.limits.get("memory")
    return None if value is None else int(parse_quantity(value))


def store_container_resources(spec: PoolSpec) -> dict[str, Any]:
    """The store container's resources; without a memory limit, one that holds the segment."""
    out = container_resources(spec.store.resources)
    if store_memory_limit(spec) is None:
        memory = format_bytes(spec.store.segment_size + STORE_MEMORY_OVERHEAD)
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
        f"--host=$({POD_IP_ENV})",
        f"--port={store.port}",
    ]
    if store.rdma_devices:
        args.append("--device_names=" + ",".join(store.rdma_devices))
    return args + list(store.extra_args)


def store_deployment(
    pool: str, namespace: str, spec: PoolSpec, master_address: str, metadata_server: str
) -> dict[str, Any]:
    """The store Deployment (standalone mode): ``mooncake_client`` pods that own the pool's memory."""
    store = spec.store
    container: dict[str, Any] = {
        "command": ["mooncake_client"],
        "args": store_args(spec, master_address, metadata_server),
        "ports": [{"name": "store", "containerPort": store.port, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": "store"}, "periodSeconds": 5},
        "livenessProbe": {
            "tcpSocket": {"port": "store"},
            "initialDelaySeconds": 15,
            "periodSeconds": 10,
        },
        "resources": store_container_resources(spec),
    }
    return component_deployment(
        pool,
        namespace,
        spec,
        names.STORE,
        container,
        replicas=store.replicas,
        strategy={"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
        pod_scheduling=scheduling(store.node_selector, store.tolerations),
        add_capabilities=["IPC_LOCK"] if store.protocol == "rdma" else None,
    )


def network_policy(pool: str, namespace: str, spec: PoolSpec) -> dict[str, Any]:
    """Ingress to master/store pods: from pods labelled with the pool (its own, consumers).

    Consumers carry the pool label on their pod template (the operator puts it there).
    Data transfers use dynamic ports, so pool pods may use any port; namespaces in
    ``networkPolicy.metricsFrom`` may also reach the master's metrics port.
    """
    rules: list[dict[str, Any]] = [{"from": [{"podSelector": {"matchLabels": {names.LABEL_POOL: pool}}}]}]
    if spec.network_policy.metrics_from:
        rules.append(
            {
                "from": [
                    {"namespaceSelector": {"matchLabels": dict(selector)}}
                    for selector in spec.network_policy.metrics_from
                ],
                "ports": [{"protocol": "TCP", "port": spec.master.metrics_port}],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": names.child_metadata(pool, namespace, names.network_policy_name(pool), "network-policy"),
        "spec": {
            "podSelector": {
                "matchLabels": {names.LABEL_POOL: pool},
                "matchExpressions": [
                    {
                        "key": names.LABEL_COMPONENT,
                        "operator": "In",
                        "values": [names.MASTER, names.STORE],
                    }
                ],
            },
            "policyTypes": ["Ingress"],
            "ingress": rules,
        },
    }
