"""Pure builders: every desired object, straight from the spec."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.operator import names
from kvpool.operator.connector_settings import pool_connector_settings
from kvpool.operator.names import DEPLOYMENTS, NETWORK_POLICIES
from kvpool.operator.plan import build_plan
from kvpool.operator.policy import OperatorPolicy
from kvpool.operator.spec import PoolSpec
from testing.operator_objects import pool_spec

NS = "team-a"


def spec(**overrides: Any) -> PoolSpec:
    return PoolSpec.model_validate(pool_spec(**overrides))


def children(raw: dict[str, Any], pool: str = "pool") -> dict[str, dict[str, Any]]:
    plan = build_plan(pool, NS, raw)
    assert plan.problems == []
    return {f"{c['kind']}/{c['metadata']['name']}": c for c in plan.children}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def test_single_master_is_recreated_and_probed() -> None:
    objs = children(
        pool_spec(master={"rpcPort": 50051, "metricsPort": 9003, "leaseTtlMs": 7000, "evictionRatio": 0.1})
    )
    master = objs["Deployment/pool-master"]
    assert master["spec"]["replicas"] == 1
    assert master["spec"]["strategy"] == {"type": "Recreate"}
    c = container(master)
    assert c["command"] == ["mooncake_master"]
    assert c["args"] == [
        "--rpc_port=50051",
        "--metrics_port=9003",
        "--eviction_high_watermark_ratio=0.95",
        "--eviction_ratio=0.1",
        "--default_kv_lease_ttl=7000",
    ]
    assert c["readinessProbe"]["tcpSocket"] == {"port": "rpc"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"rpc": 50051, "metrics": 9003}
    assert master["spec"]["selector"]["matchLabels"] == names.selector("pool", "master")
    labels = master["spec"]["template"]["metadata"]["labels"]
    assert labels.items() >= master["spec"]["selector"]["matchLabels"].items()


def test_ha_master_uses_etcd_and_rolls() -> None:
    raw = pool_spec(
        master={"replicas": 3, "ha": {"enabled": True, "etcdEndpoints": ["etcd-0:2379", "etcd-1:2379"]}}
    )
    plan = build_plan("pool", NS, raw)
    assert plan.problems == []
    master = next(
        c for c in plan.children if c["metadata"]["name"] == "pool-master" and c["kind"] == "Deployment"
    )
    assert master["spec"]["replicas"] == 3
    # One master at a time: a standby is ready (healthy) though it serves no RPC.
    assert master["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0},
    }
    c = container(master)
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    (spread,) = master["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["maxSkew"] == 1
    assert spread["whenUnsatisfiable"] == "DoNotSchedule"
    assert spread["labelSelector"] == {"matchLabels": names.selector("pool", "master")}
    args = c["args"]
    assert "--enable_ha=true" in args
    assert "--ha_backend_type=etcd" in args
    assert "--etcd_endpoints=etcd-0:2379,etcd-1:2379" in args
    assert "--rpc_address=$(POD_IP)" in args
    assert "--enable_oplog=true" in args  # standbys replay the leader's index
    assert plan.master_address == "etcd://etcd-0:2379,etcd-1:2379"
    kv = json.loads(plan.consumers[0].kv_transfer_config)
    assert kv["kv_connector_extra_config"]["master_server_address"] == plan.master_address


@pytest.mark.parametrize(
    ("ha", "cluster_id"), [({}, "team-a.pool"), ({"clusterId": "fleet-1.pool"}, "fleet-1.pool")]
)
def test_an_ha_pool_names_its_election_for_masters_stores_and_consumers(
    ha: dict[str, Any], cluster_id: str
) -> None:
    """Mooncake keeps an HA election under its cluster id: every part of the pool gets the pool's own."""
    raw = pool_spec(master={"replicas": 2, "ha": {"enabled": True, "etcdEndpoints": ["etcd-0:2379"], **ha}})
    plan = build_plan("pool", NS, raw)
    assert plan.problems == []
    objs = {f"{c['kind']}/{c['metadata']['name']}": c for c in plan.children}
    assert f"--cluster_id={cluster_id}" in container(objs["Deployment/pool-master"])["args"]
    store_env = container(objs["Deployment/pool-store"])["env"]
    assert {"name": "MC_STORE_CLUSTER_ID", "value": cluster_id} in store_env
    kv = json.loads(plan.consumers[0].kv_transfer_config)
    assert kv["kv_connector_extra_config"]["cluster_id"] == cluster_id


def test_an_ha_pool_may_elect_through_etcd_only() -> None:
    raw = pool_spec(
        master={"replicas": 2, "ha": {"enabled": True, "etcdEndpoints": ["e:2379"], "replicateIndex": False}}
    )
    args = container(children(raw)["Deployment/pool-master"])["args"]
    assert "--enable_ha=true" in args and not any(a.startswith("--enable_oplog") for a in args)


def test_a_single_master_pool_names_no_cluster() -> None:
    plan = build_plan("pool", NS, pool_spec())
    objs = {f"{c['kind']}/{c['metadata']['name']}": c for c in plan.children}
    assert not any(a.startswith("--cluster_id") for a in container(objs["Deployment/pool-master"])["args"])
    assert all(e["name"] != "MC_STORE_CLUSTER_ID" for e in container(objs["Deployment/pool-store"])["env"])
    assert "cluster_id" not in json.loads(plan.consumers[0].kv_transfer_config)["kv_connector_extra_config"]


def test_master_service_exposes_rpc_and_metrics() -> None:
    service = children(pool_spec())["Service/pool-master"]
    assert service["spec"]["selector"] == names.selector("pool", "master")
    assert [(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [
        ("rpc", 50051, "rpc"),
        ("metrics", 9003, "metrics"),
    ]


def test_store_pods_hold_the_segment() -> None:
    store = children(
        pool_spec(store={"segmentSize": "2GB", "replicas": 3, "port": 50060, "nodeSelector": {"pool": "mem"}})
    )["Deployment/pool-store"]
    assert store["spec"]["replicas"] == 3
    c = container(store)
    assert c["command"] == ["mooncake_client"]
    assert "--global_segment_size=2147483648" in c["args"]
    assert "--master_server_address=pool-master.team-a.svc:50051" in c["args"]
    assert "--metadata_server=P2PHANDSHAKE" in c["args"]
    assert "--port=50060" in c["args"]
    # No memory limit given: one that holds the segment plus overhead.
    assert c["resources"]["limits"]["memory"] == "2560Mi"
    assert store["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "mem"}


def test_store_keeps_an_explicit_limit_and_rdma_gets_its_devices() -> None:
    raw = pool_spec(
        store={
            "segmentSize": "1GB",
            "protocol": "rdma",
            "rdmaDevices": ["mlx5_0", "mlx5_1"],
            "resources": {"limits": {"memory": "4Gi", "cpu": 2}},
        }
    )
    c = container(children(raw)["Deployment/pool-store"])
    assert c["resources"] == {"limits": {"memory": "4Gi", "cpu": 2}}
    assert "--device_names=mlx5_0,mlx5_1" in c["args"]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}


def test_every_pod_runs_as_non_root() -> None:
    for obj in children(pool_spec()).values():
        if obj["kind"] != "Deployment":
            continue
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert "ALL" in sc["capabilities"]["drop"]


def test_every_scratch_volume_has_a_size_limit() -> None:
    # An emptyDir without one can fill the node's disk under every other tenant's pods.
    tier = {"capacity": "1GB", "volume": {"type": "emptyDir", "size": "1GB"}}
    for raw in (
        pool_spec(),
        pool_spec(master={"replicas": 2, "ha": {"enabled": True, "etcdEndpoints": ["etcd:2379"]}}),
        pool_spec(store={"segmentSize": "1GB", "replicas": 1, "diskTier": tier}),
    ):
        deployments = [obj for obj in children(raw).values() if obj["kind"] == "Deployment"]
        volumes = [v for d in deployments for v in d["spec"]["template"]["spec"].get("volumes", [])]
        scratch = [v for v in volumes if "emptyDir" in v]
        assert len(scratch) >= len(deployments)
        assert all(v["emptyDir"].get("sizeLimit") for v in scratch), scratch


def test_configmap_is_the_contracts_rendering() -> None:
    raw = pool_spec(connector={"cache_prefix": "team-a", "batch_size": 64, "save_decode_cache": True})
    configmap = children(raw)["ConfigMap/pool-connector"]
    settings = ConnectorSettings.parse(
        {
            "master_server_address": "pool-master.team-a.svc:50051",
            "cache_prefix": "team-a",
            "batch_size": 64,
            "save_decode_cache": True,
        }
    )
    assert configmap["data"][names.MOONCAKE_CONFIG_FILE] == (
        json.dumps(settings.mooncake_config(), indent=2, sort_keys=True) + "\n"
    )
    # The contract's transfer config: the settings that are not the contract's defaults, and
    # the file's fields.
    rendered = json.loads(configmap["data"][names.KV_TRANSFER_CONFIG_FILE])
    assert rendered["kv_connector_extra_config"] == {
        "cache_prefix": "team-a",
        "batch_size": 64,
        "save_decode_cache": True,
        **settings.mooncake_config(),
    }
    contract = settings.kv_transfer_config()
    assert {k: v for k, v in rendered.items() if k != "kv_connector_extra_config"} == {
        k: v for k, v in contract.items() if k != "kv_connector_extra_config"
    }
    assert ConnectorSettings.parse(rendered["kv_connector_extra_config"]) == settings


def test_embedded_mode_has_no_store_pods_and_gives_vllm_the_segment() -> None:
    raw = pool_spec(store={"mode": "embedded", "segmentSize": "512MB"})
    plan = build_plan("pool", NS, raw)
    assert plan.problems == []
    assert plan.embedded
    assert not any(c["metadata"]["name"] == "pool-store" for c in plan.children)
    assert (DEPLOYMENTS, "pool-store") in plan.absent
    settings = pool_connector_settings("pool", NS, spec(store={"mode": "embedded", "segmentSize": "512MB"}))
    assert settings.global_segment_size == 512 << 20
    assert pool_connector_settings("pool", NS, spec()).global_segment_size == 0


SCRAPER = {
    "namespaceSelector": {"kubernetes.io/metadata.name": "monitoring"},
    "podSelector": {"app.kubernetes.io/name": "prometheus"},
}


#: The pool's own pods, never a same-named pool's consumers from another namespace.
OWN_PODS = {
    "podSelector": {
        "matchLabels": {names.LABEL_POOL: "pool"},
        "matchExpressions": [{"key": names.LABEL_POOL_NAMESPACE, "operator": "DoesNotExist"}],
    }
}


def test_network_policy_admits_only_the_pool_and_named_scraper_pods() -> None:
    raw = pool_spec(networkPolicy={"metricsFrom": [SCRAPER]})
    policy = children(raw)["NetworkPolicy/pool-kvpool"]
    selector = policy["spec"]["podSelector"]
    assert selector["matchLabels"] == {names.LABEL_POOL: "pool"}
    assert selector["matchExpressions"][0]["values"] == ["master", "store"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    own, metrics = policy["spec"]["ingress"]
    assert own == {"from": [OWN_PODS]}
    assert metrics["ports"] == [{"protocol": "TCP", "port": 9003}]
    # One peer with both selectors: pods so labelled, in namespaces so labelled (never a whole namespace).
    assert metrics["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        }
    ]
    opt_out = OperatorPolicy(allow_network_policy_opt_out=True)
    disabled = build_plan("pool", NS, pool_spec(networkPolicy={"enabled": False}), opt_out)
    assert (NETWORK_POLICIES, "pool-kvpool") in disabled.absent
    assert (NETWORK_POLICIES, "pool-consumers") in disabled.absent


def test_consumer_hash_follows_settings_and_layout_only() -> None:
    def injection(raw: dict[str, Any]) -> Any:
        return build_plan("pool", NS, raw).consumers[0]

    base = injection(pool_spec())
    assert base.config_hash == injection(pool_spec()).config_hash
    assert injection(pool_spec(master={"leaseTtlMs": 9000})).config_hash == base.config_hash
    assert injection(pool_spec(connector={"cache_prefix": "other"})).config_hash != base.config_hash
    changed_layout = pool_spec()
    changed_layout["consumers"][0]["layout"]["groups"][1]["sliding_window"] = 2048
    changed = injection(changed_layout)
    assert changed.layout_fingerprint != base.layout_fingerprint
    assert changed.config_hash != base.config_hash


def test_builders_are_deterministic() -> None:
    assert build_plan("pool", NS, pool_spec()) == build_plan("pool", NS, pool_spec())


def test_masters_get_default_requests_and_limits_unless_given() -> None:
    c = container(children(pool_spec())["Deployment/pool-master"])
    assert c["resources"] == {"limits": {"memory": "2Gi"}, "requests": {"cpu": "250m", "memory": "512Mi"}}
    # A resource the spec gives (a request or a limit) is left as given; the others take the default.
    given = pool_spec(master={"resources": {"limits": {"memory": "4Gi"}}})
    c = container(children(given)["Deployment/pool-master"])
    assert c["resources"] == {"limits": {"memory": "4Gi"}, "requests": {"cpu": "250m"}}


def test_every_container_requests_cpu_and_memory_unless_the_spec_limits_them() -> None:
    # A ResourceQuota on requests.cpu or requests.memory refuses a pod with a container that has none.
    for raw in (pool_spec(), pool_spec(store={"segmentSize": "1GB", "drainTimeoutSeconds": 30})):
        for obj in children(raw).values():
            if obj["kind"] != "Deployment":
                continue
            pod = obj["spec"]["template"]["spec"]
            for c in [*pod.get("initContainers", []), *pod["containers"]]:
                requests = c["resources"].get("requests", {})
                assert {"cpu", "memory"} <= set(requests), (c["name"], c["resources"])
    store = container(children(pool_spec())["Deployment/pool-store"])
    assert store["resources"]["requests"]["cpu"] == "250m"
    # A CPU limit the spec gives is left as given (the API server makes the request equal to it).
    limited = pool_spec(store={"resources": {"limits": {"cpu": 2}}})
    given = container(children(limited)["Deployment/pool-store"])
    assert given["resources"]["limits"]["cpu"] == 2 and "cpu" not in given["resources"]["requests"]


def test_disruption_budgets_spreading_and_priority() -> None:
    raw = pool_spec(
        master={
            "replicas": 3,
            "ha": {"enabled": True, "etcdEndpoints": ["etcd:2379"]},
            "priorityClassName": "kv-critical",
        },
        store={"segmentSize": "1GB", "replicas": 3, "priorityClassName": "kv-store"},
    )
    objs = children(raw)
    for component in ("master", "store"):
        pdb = objs[f"PodDisruptionBudget/pool-{component}"]
        assert pdb["apiVersion"] == "policy/v1"
        selector = {"matchLabels": names.selector("pool", component)}
        assert pdb["spec"] == {
            "maxUnavailable": 1,
            "selector": selector,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        }
        pod = objs[f"Deployment/pool-{component}"]["spec"]["template"]["spec"]
        assert pod["priorityClassName"] == f"kv-{'critical' if component == 'master' else 'store'}"
        (spread,) = pod["topologySpreadConstraints"]
        assert spread["labelSelector"] == {"matchLabels": names.selector("pool", component)}
    store_pod = objs["Deployment/pool-store"]["spec"]["template"]["spec"]
    assert store_pod["topologySpreadConstraints"][0]["whenUnsatisfiable"] == "ScheduleAnyway"
    # One master: nothing to spread; no priority class unless asked. Stores are spread
    # whatever their count (see test_scaling_stores_changes_no_pod_template).
    single = children(pool_spec(store={"segmentSize": "1GB", "replicas": 1}))
    # A drain never evicts the only master (it holds the pool's metadata); one that is not
    # Ready serves nothing and never blocks a drain.
    only_master = single["PodDisruptionBudget/pool-master"]["spec"]
    assert only_master["maxUnavailable"] == 0
    assert only_master["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    for component in ("master", "store"):
        pod = single[f"Deployment/pool-{component}"]["spec"]["template"]["spec"]
        assert "priorityClassName" not in pod
        assert ("topologySpreadConstraints" in pod) == (component == "store")
    embedded = build_plan("pool", NS, pool_spec(store={"mode": "embedded"}))
    assert (names.POD_DISRUPTION_BUDGETS, "pool-store") in embedded.absent


def test_consumers_transfer_ports_are_closed_to_all_but_the_pool() -> None:
    from kvpool.operator.network import TRANSFER_PORT_MAX, TRANSFER_PORT_MIN

    policy = children(pool_spec())["NetworkPolicy/pool-consumers"]
    selector = policy["spec"]["podSelector"]
    # Consumer pods: the pool label the injection puts on them, and no component label.
    assert selector == {
        "matchLabels": {names.LABEL_POOL: "pool"},
        "matchExpressions": [
            {"key": names.LABEL_COMPONENT, "operator": "DoesNotExist"},
            {"key": names.LABEL_POOL_NAMESPACE, "operator": "DoesNotExist"},
        ],
    }
    pool_rule, others = policy["spec"]["ingress"]
    assert pool_rule == {"from": [OWN_PODS]}
    assert "from" not in others  # anyone ...
    tcp = [(p["port"], p["endPort"]) for p in others["ports"] if p["protocol"] == "TCP"]
    assert tcp == [(1, TRANSFER_PORT_MIN - 1), (TRANSFER_PORT_MAX + 1, 65535)]  # ... but the transfer ports
    assert {"protocol": "UDP", "port": 1, "endPort": 65535} in others["ports"]
    # The consumers' transfer engine is pinned to that range.
    env = dict(build_plan("pool", NS, pool_spec()).consumers[0].env)
    pinned = (env["MC_MIN_RPC_PORT"], env["MC_MAX_RPC_PORT"])
    assert pinned == (str(TRANSFER_PORT_MIN), str(TRANSFER_PORT_MAX))
    # Embedded mode (vLLM ranks hold the pool's memory): covered the same way.
    embedded = children(pool_spec(store={"mode": "embedded"}))
    assert embedded["NetworkPolicy/pool-consumers"] == policy


def test_etcd_is_restricted_to_the_pool_when_its_pods_are_named() -> None:
    ha = {"replicas": 2, "ha": {"enabled": True, "etcdEndpoints": ["etcd-0.etcd:2379", "etcd-1.etcd:2379"]}}
    assert "NetworkPolicy/pool-etcd" not in children(pool_spec(master=ha))
    ha["ha"]["etcdPodSelector"] = {"app": "etcd"}
    policy = children(pool_spec(master=ha))["NetworkPolicy/pool-etcd"]
    assert policy["spec"]["podSelector"] == {"matchLabels": {"app": "etcd"}}
    pool_rule, peers = policy["spec"]["ingress"]
    assert pool_rule == {
        "from": [OWN_PODS],
        "ports": [{"protocol": "TCP", "port": 2379}],
    }
    assert peers == {"from": [{"podSelector": {"matchLabels": {"app": "etcd"}}}]}


def test_the_operator_alone_may_ask_the_masters_http_port() -> None:
    """Its pods (namespace and labels), for the HA leader and every pool's capacity: never a
    wider selector; without its pods known, no rule at all."""
    from kvpool.operator.policy import OperatorPolicy

    ha = pool_spec(master={"replicas": 2, "ha": {"enabled": True, "etcdEndpoints": ["etcd:2379"]}})
    policy = OperatorPolicy(operator_namespace="kvpool-system", operator_pod_labels=(("app", "op"),))
    plan = build_plan("pool", NS, ha, policy)
    netpol = next(c for c in plan.children if c["metadata"]["name"] == "pool-kvpool")
    operator_rule = netpol["spec"]["ingress"][-1]
    assert operator_rule == {
        "from": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kvpool-system"}},
                "podSelector": {"matchLabels": {"app": "op"}},
            }
        ],
        "ports": [{"protocol": "TCP", "port": 9003}],
    }
    single = build_plan("pool", NS, pool_spec(), policy)
    (single_policy,) = [c for c in single.children if c["metadata"]["name"] == "pool-kvpool"]
    assert single_policy["spec"]["ingress"][1:] == [operator_rule]
    assert single.observed
    unknown = build_plan("pool", NS, pool_spec())
    (unknown_policy,) = [c for c in unknown.children if c["metadata"]["name"] == "pool-kvpool"]
    assert len(unknown_policy["spec"]["ingress"]) == 1 and not unknown.observed


@pytest.mark.parametrize("before, after", [(1, 2), (2, 5), (5, 1), (3, 2)])
def test_scaling_stores_changes_no_pod_template(before: int, after: int) -> None:
    """Scaling changes ``replicas`` alone: the Deployment controller then adds or removes pods
    and restarts none of the others (a changed template would roll every store, and lose
    what each one holds)."""

    def store(replicas: int) -> dict[str, Any]:
        return children(pool_spec(store={"segmentSize": "1GB", "replicas": replicas}))[
            "Deployment/pool-store"
        ]

    old, new = store(before), store(after)
    assert old["spec"]["template"] == new["spec"]["template"]
    assert {k: v for k, v in old["spec"].items() if k != "replicas"} == {
        k: v for k, v in new["spec"].items() if k != "replicas"
    }
    assert (old["spec"]["replicas"], new["spec"]["replicas"]) == (before, after)
