"""The pool's Mooncake components: master and store Deployments (one pod builder), the master
Service and their PodDisruptionBudgets. Pure: a spec in, manifests out.

HA masters elect a leader through etcd; a standby serves no RPC until it leads, but every
master answers ``GET /health`` on its metrics port (``role``: leader or standby). So HA
masters are ready when healthy, roll one at a time, and whether a leader serves is asked
of ``/health`` (``leader``).
"""

from __future__ import annotations

from typing import Any

from kvpool.connector.contract import mooncake_env, tenant_policy
from kvpool.operator import names
from kvpool.operator.disk_tier import OFFLOAD_FLAG, master_tier_args, tier_env, tier_mount, tier_volume
from kvpool.operator.spec import ComputeResources, PoolSpec, Toleration, format_bytes, parse_quantity
from kvpool.operator.store_probe import probe_env, readiness_probe
from kvpool.operator.store_wait import wait_container

RUN_AS_USER = 1000
POD_IP_ENV = "POD_IP"
TMP_VOLUME = "tmp"
# Mooncake logs to stderr; /tmp holds only small files (the store probe's memory). Past the
# limit the kubelet evicts the pod, never the node's other tenants.
TMP_SIZE_LIMIT = "64Mi"
MASTER_HEALTH_PATH = "/health"
# Memory a store pod needs beyond its segment (process, transfer buffers).
STORE_MEMORY_OVERHEAD = 512 << 20
# A master's requests and limits where the spec gives a resource neither.
MASTER_DEFAULT_RESOURCES: dict[str, dict[str, str]] = {
    "requests": {"cpu": "250m", "memory": "512Mi"},
    "limits": {"memory": "2Gi"},
}
NODE_TOPOLOGY_KEY = "kubernetes.io/hostname"

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


def container_resources(
    spec: ComputeResources, defaults: dict[str, dict[str, str]] | None = None
) -> dict[str, Any]:
    """A container's ``resources`` (only the parts that are set).

    A resource (``cpu``, ``memory``) the spec gives neither a request nor a limit takes
    its request and limit from ``defaults``; one the spec gives either is left as given
    (the API server then makes a missing request equal to the limit).
    """
    out = {key: dict(value) for key, value in (("limits", spec.limits), ("requests", spec.requests)) if value}
    given = set(spec.limits) | set(spec.requests)
    for key, values in (defaults or {}).items():
        for resource, quantity in values.items():
            if resource not in given:
                out.setdefault(key, {})[resource] = quantity
    return {key: out[key] for key in ("limits", "requests") if key in out}


def topology_spread(pool: str, component: str, *, hard: bool) -> dict[str, Any]:
    """Spread a component's pods across nodes (at most one more on any node than on another)."""
    return {
        "maxSkew": 1,
        "topologyKey": NODE_TOPOLOGY_KEY,
        "whenUnsatisfiable": "DoNotSchedule" if hard else "ScheduleAnyway",
        "labelSelector": {"matchLabels": names.selector(pool, component)},
        "matchLabelKeys": ["pod-template-hash"],
    }


def scheduling(
    node_selector: dict[str, str],
    tolerations: list[Toleration],
    priority_class_name: str | None = None,
    spread: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``nodeSelector``, ``tolerations``, ``priorityClassName`` and spreading of a pod spec, when set."""
    out: dict[str, Any] = {}
    if node_selector:
        out["nodeSelector"] = dict(node_selector)
    if tolerations:
        out["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in tolerations]
    if priority_class_name:
        out["priorityClassName"] = priority_class_name
    if spread:
        out["topologySpreadConstraints"] = [spread]
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
    env: list[dict[str, Any]] | None = None,
    volumes: list[dict[str, Any]] | None = None,
    mounts: list[dict[str, Any]] | None = None,
    init_containers: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A Deployment of one hardened container named ``component``, running the pool's image.

    ``container`` holds what differs between components (command, args, ports, probes,
    resources); image, ``POD_IP``, security contexts and a writable ``/tmp`` are shared;
    ``env``, ``volumes`` and ``mounts`` come after the shared ones. ``init_containers`` run
    the same image, hardened the same way (without capabilities).
    """
    hardened = {"image": str(spec.image), "imagePullPolicy": spec.image_pull_policy}
    inits = [
        {**init, **hardened, "securityContext": container_security_context(None)}
        for init in init_containers or []
    ]
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
                    **({"initContainers": inits} if inits else {}),
                    "containers": [
                        {
                            "name": component,
                            "image": str(spec.image),
                            "imagePullPolicy": spec.image_pull_policy,
                            **container,
                            "env": [pod_ip_env(), *(env or [])],
                            "securityContext": container_security_context(add_capabilities),
                            "volumeMounts": [{"name": TMP_VOLUME, "mountPath": "/tmp"}, *(mounts or [])],
                        }
                    ],
                    # A writable /tmp beside the read-only root filesystem.
                    "volumes": [tmp_volume(), *(volumes or [])],
                    **pod_scheduling,
                },
            },
        },
    }


def tmp_volume() -> dict[str, Any]:
    """The pod's writable ``/tmp``, bounded."""
    return {"name": TMP_VOLUME, "emptyDir": {"sizeLimit": TMP_SIZE_LIMIT}}


# Mooncake's etcd client takes several endpoints separated by "," or ";" (both tried with a
# real three-member etcd cluster whose first member is down); "," is what the connector's
# settings document.
ETCD_ENDPOINT_SEPARATOR = ","


def master_address(pool: str, namespace: str, spec: PoolSpec) -> str:
    """What clients put in ``master_server_address``: the Service, or etcd when HA; an
    external pool's own."""
    if spec.external is not None:
        return spec.external.master_server_address
    if spec.master.ha.enabled:
        return "etcd://" + ETCD_ENDPOINT_SEPARATOR.join(spec.master.ha.etcd_endpoints)
    return f"{names.master_name(pool)}.{namespace}.svc:{spec.master.rpc_port}"


def ha_cluster_id(pool: str, namespace: str, spec: PoolSpec) -> str:
    """The Mooncake cluster id of the pool's HA masters ("" for a single master): it names
    their leader election in etcd, so pools sharing an etcd never elect each other's masters.
    ``spec.master.ha.clusterId``, else ``<namespace>.<pool>``; an external pool's own."""
    if spec.external is not None:
        return spec.external.cluster_id
    if not spec.master.ha.enabled:
        return ""
    return spec.master.ha.cluster_id or f"{namespace}.{pool}"


def master_args(spec: PoolSpec, cluster_id: str = "") -> list[str]:
    """``mooncake_master`` flags for the spec (``cluster_id``: :func:`ha_cluster_id`)."""
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
            "--etcd_endpoints=" + ETCD_ENDPOINT_SEPARATOR.join(master.ha.etcd_endpoints),
            f"--rpc_address=$({POD_IP_ENV})",
        ]
        if cluster_id:
            args.append(f"--cluster_id={cluster_id}")
        if master.ha.replicate_index:
            args.append("--enable_oplog=true")
    if spec.tenancy.enabled:
        args += tenant_policy.master_args(f"{names.TENANTS_MOUNT_PATH}/{tenant_policy.POLICY_FILE}")
    return args + master_tier_args(spec) + list(master.extra_args)


def master_probes(spec: PoolSpec) -> dict[str, Any]:
    """Liveness: ``/health`` answers. Readiness: a single master serves RPC; an HA master is
    healthy (a standby serves no RPC until it leads, yet is ready to take over)."""
    health = {"httpGet": {"path": MASTER_HEALTH_PATH, "port": "metrics"}}
    readiness = health if spec.master.ha.enabled else {"tcpSocket": {"port": "rpc"}}
    return {
        "readinessProbe": {**readiness, "periodSeconds": 5},
        "livenessProbe": {**health, "initialDelaySeconds": 10, "periodSeconds": 10, "failureThreshold": 3},
    }


def master_deployment(pool: str, namespace: str, spec: PoolSpec) -> dict[str, Any]:
    """The master Deployment: Recreate when single; when HA, one master at a time, spread over nodes."""
    master = spec.master
    container: dict[str, Any] = {
        "command": ["mooncake_master"],
        "args": master_args(spec, ha_cluster_id(pool, namespace, spec)),
        "ports": [
            {"name": "rpc", "containerPort": master.rpc_port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": master.metrics_port, "protocol": "TCP"},
        ],
        **master_probes(spec),
        "resources": container_resources(master.resources, MASTER_DEFAULT_RESOURCES),
    }
    strategy: dict[str, Any] = (
        {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}
        if master.ha.enabled
        else {"type": "Recreate"}
    )
    spread = topology_spread(pool, names.MASTER, hard=True) if master.ha.enabled else None
    tenants = {"name": "tenants", "configMap": {"name": names.tenants_configmap_name(pool)}}
    return component_deployment(
        pool,
        namespace,
        spec,
        names.MASTER,
        container,
        replicas=master.replicas,
        strategy=strategy,
        pod_scheduling=scheduling(
            master.node_selector, master.tolerations, master.priority_class_name, spread
        ),
        volumes=[tenants] if spec.tenancy.enabled else None,
        mounts=[{"name": "tenants", "mountPath": names.TENANTS_MOUNT_PATH, "readOnly": True}]
        if spec.tenancy.enabled
        else None,
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


# A store's CPU request where the spec gives its CPU neither a request nor a limit: a namespace
# whose ResourceQuota caps requests.cpu admits no pod with a container that has none.
STORE_DEFAULT_RESOURCES: dict[str, dict[str, str]] = {"requests": {"cpu": "250m"}}

# RDMA stores lock their registered memory; the restricted Pod Security Standard allows no
# added capability but NET_BIND_SERVICE.
STORE_RDMA_CAPABILITIES = ["IPC_LOCK"]


def store_memory_limit(spec: PoolSpec) -> int | None:
    """The store container's memory limit in bytes, if the spec sets one."""
    value = spec.store.resources.limits.get("memory")
    return None if value is None else int(parse_quantity(value))


def store_container_resources(spec: PoolSpec) -> dict[str, Any]:
    """The store container's resources; without a memory limit, one that holds the segment;
    without any CPU, the default request."""
    out = container_resources(spec.store.resources, STORE_DEFAULT_RESOURCES)
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
    if store.disk_tier is not None:
        args.append(OFFLOAD_FLAG)
    return args + list(store.extra_args)


def cluster_id_env(cluster_id: str) -> list[dict[str, str]]:
    """The env entry under which a Mooncake client finds its HA pool's leader (none without one)."""
    return [{"name": mooncake_env.CLUSTER_ID, "value": cluster_id}] if cluster_id else []


def drains_on_scale_down(spec: PoolSpec) -> bool:
    """Whether a scale-down of the spec's store pods drains them first (``store_drain``)."""
    return spec.store.mode == "standalone" and spec.store.drain_timeout_seconds > 0


def store_deployment(
    pool: str, namespace: str, spec: PoolSpec, master_address: str, metadata_server: str
) -> dict[str, Any]:
    """The store Deployment (standalone mode): ``mooncake_client`` pods that own the pool's memory,
    started once their master serves (``store_wait``'s init container).

    When scale-downs drain (``drainTimeoutSeconds`` > 0), a store is ready
    while its port answers and the master does not say its segment is drained
    (``store_probe``); otherwise while its port answers."""
    store = spec.store
    drains = drains_on_scale_down(spec)
    container: dict[str, Any] = {
        "command": ["mooncake_client"],
        "args": store_args(spec, master_address, metadata_server),
        "ports": [{"name": "store", "containerPort": store.port, "protocol": "TCP"}],
        "readinessProbe": (
            readiness_probe() if drains else {"tcpSocket": {"port": "store"}, "periodSeconds": 5}
        ),
        "livenessProbe": {
            "tcpSocket": {"port": "store"},
            "initialDelaySeconds": 15,
            "periodSeconds": 10,
        },
        "resources": store_container_resources(spec),
    }
    # Spread whatever the replica count: a template that changed with ``replicas`` would
    # restart every store (and lose what it holds) when the pool is scaled.
    spread = topology_spread(pool, names.STORE, hard=False)
    tier = store.disk_tier
    return component_deployment(
        pool,
        namespace,
        spec,
        names.STORE,
        container,
        replicas=store.replicas,
        strategy={"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
        pod_scheduling=scheduling(store.node_selector, store.tolerations, store.priority_class_name, spread),
        add_capabilities=STORE_RDMA_CAPABILITIES if store.protocol == "rdma" else None,
        env=[
            *cluster_id_env(ha_cluster_id(pool, namespace, spec)),
            *(probe_env(pool, namespace, spec.master.metrics_port, store.port) if drains else []),
            *(tier_env(tier) if tier else []),
        ],
        volumes=[tier_volume(tier)] if tier else None,
        mounts=[tier_mount()] if tier else None,
        init_containers=[wait_container(pool, namespace, spec.master.metrics_port)],
    )


def pod_disruption_budget(
    pool: str, namespace: str, component: str, *, only_pod: bool = False
) -> dict[str, Any]:
    """How many of a component's pods a drain may evict at once.

    ``only_pod``: the component's one pod holds what nothing else has (a single master holds
    the whole pool's metadata), so no voluntary eviction at all (``maxUnavailable: 0``): a
    drain waits until someone moves that pod deliberately. Otherwise one pod at a time (an HA
    master set keeps N-1; a store pod's loss is the cache it held). A pod that is not Ready
    serves nothing, so it never blocks a drain (``unhealthyPodEvictionPolicy: AlwaysAllow``).
    """
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": names.child_metadata(pool, namespace, names.component_name(pool, component), component),
        "spec": {
            "maxUnavailable": 0 if only_pod else 1,
            "selector": {"matchLabels": names.selector(pool, component)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
