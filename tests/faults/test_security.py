"""Security checks on what the operator builds.

* The master's HTTP port (``metricsPort``) is an admin port: a real ``mooncake_master``
  serves every key and the store's buffer addresses on it. The NetworkPolicy the operator
  builds must let only the pool's own pods reach it (and the RPC port), plus the
  ``metricsFrom`` scraper pods on that one port; checked by evaluating the policy for
  concrete peers with Kubernetes' NetworkPolicy semantics.
* The master and store pods run as non-root, without privilege escalation, with a
  read-only root filesystem, all capabilities dropped and no service-account token.

Token ids in spans, metric labels and logs: tests/connector/observability/test_observability.py. The chart's
operator pod: tests/chart/test_chart_operator.py.
"""

from __future__ import annotations

import shutil
import urllib.request
from typing import Any

import pytest

from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.local.pool import LocalPool
from kvpool.connector.pool_client import open_client
from kvpool.operator import names
from kvpool.operator.plan import build_plan
from testing.operator_objects import pool_spec
from testing.pool_store import put_bytes

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

NAMESPACE = "team-a"
ALL = frozenset({"*"})
MONITORING = {"kubernetes.io/metadata.name": "monitoring", "team": "observability"}
# metricsFrom names the scraper's pods: its namespace's labels and its own.
SCRAPER = {"namespaceSelector": {"team": "observability"}, "podSelector": {"app": "prometheus"}}


# --- a NetworkPolicy evaluator (ingress, pod peers) ---------------------------------------------


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (``{}`` selects everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def peer_matches(peer: dict[str, Any], policy_ns: str, who: dict[str, Any]) -> bool:
    assert "ipBlock" not in peer, "an ipBlock would let traffic in by address"
    pods, namespaces = peer.get("podSelector"), peer.get("namespaceSelector")
    if namespaces is None:
        return who["namespace"] == policy_ns and selects(pods, who["labels"])
    return selects(namespaces, who["namespace_labels"]) and selects(pods, who["labels"])


def reachable_ports(policy: dict[str, Any], target: dict[str, Any], who: dict[str, Any]) -> frozenset:
    """The target pod's ports ``who`` may connect to (``ALL``: every port)."""
    spec = policy["spec"]
    if not selects(spec["podSelector"], target["labels"]) or "Ingress" not in spec["policyTypes"]:
        return ALL  # not isolated by this policy
    ports: set[Any] = set()
    for rule in spec.get("ingress") or []:
        peers = rule.get("from")
        if peers and not any(peer_matches(p, policy["metadata"]["namespace"], who) for p in peers):
            continue
        if not rule.get("ports"):
            return ALL
        for port in rule["ports"]:
            assert port.get("protocol", "TCP") == "TCP"
            value = port["port"]
            ports.add(target["named_ports"].get(value, value))
    return frozenset(ports)


def pod_of(deployment: dict[str, Any]) -> dict[str, Any]:
    template = deployment["spec"]["template"]
    named = {
        p["name"]: p["containerPort"]
        for c in template["spec"]["containers"]
        for p in c.get("ports", [])
        if "name" in p
    }
    return {"labels": template["metadata"]["labels"], "named_ports": named}


def peers(pool: str, metrics_ns: dict[str, str]) -> dict[str, dict[str, Any]]:
    ns_labels = {"kubernetes.io/metadata.name": NAMESPACE}
    return {
        "consumer": {
            "namespace": NAMESPACE,
            "namespace_labels": ns_labels,
            "labels": {names.LABEL_POOL: pool},
        },
        "neighbour": {"namespace": NAMESPACE, "namespace_labels": ns_labels, "labels": {"app": "other"}},
        "monitoring": {
            "namespace": "monitoring",
            "namespace_labels": metrics_ns,
            "labels": {"app": "prometheus"},
        },
        "monitoring-neighbour": {  # another pod in the scraper's namespace
            "namespace": "monitoring",
            "namespace_labels": metrics_ns,
            "labels": {"app": "grafana"},
        },
        "stranger": {
            "namespace": "elsewhere",
            "namespace_labels": {"kubernetes.io/metadata.name": "elsewhere"},
            "labels": {names.LABEL_POOL: pool},  # the right label in the wrong namespace
        },
    }


def children(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    plan = build_plan("pool", NAMESPACE, spec)
    assert plan.valid, plan.problems
    return {f"{c['kind']}/{c['metadata']['name']}": c for c in plan.children}


SPECS = {
    "single": pool_spec(),
    "ha": pool_spec(master={"replicas": 2, "ha": {"enabled": True, "etcdEndpoints": ["etcd.team-a:2379"]}}),
    "metrics-from": pool_spec(networkPolicy={"metricsFrom": [SCRAPER]}),
}


@pytest.mark.parametrize("case", sorted(SPECS))
def test_network_policy_covers_the_master_admin_and_rpc_ports(case: str) -> None:
    spec = SPECS[case]
    objects = children(spec)
    policy = objects["NetworkPolicy/pool-kvpool"]
    master = objects["Deployment/pool-master"]
    store = objects["Deployment/pool-store"]
    master_pod, store_pod = pod_of(master), pod_of(store)
    rpc, admin = master_pod["named_ports"]["rpc"], master_pod["named_ports"]["metrics"]
    service_ports = {p["name"]: p["port"] for p in objects["Service/pool-master"]["spec"]["ports"]}
    assert service_ports == {"rpc": rpc, "metrics": admin}, (
        "every port the Service exposes is one checked here"
    )

    who = peers("pool", MONITORING)
    metrics_from = case == "metrics-from"
    assert reachable_ports(policy, master_pod, who["consumer"]) == ALL
    assert reachable_ports(policy, master_pod, who["neighbour"]) == frozenset()
    assert reachable_ports(policy, master_pod, who["stranger"]) == frozenset()
    assert reachable_ports(policy, master_pod, who["monitoring"]) == (
        frozenset({admin}) if metrics_from else frozenset()
    )
    assert rpc not in reachable_ports(policy, master_pod, who["monitoring"])
    assert reachable_ports(policy, master_pod, who["monitoring-neighbour"]) == frozenset()
    # The store pods: only the pool's own pods, whatever port.
    assert reachable_ports(policy, store_pod, who["consumer"]) == ALL
    for outsider in ("neighbour", "stranger"):
        assert reachable_ports(policy, store_pod, who[outsider]) == frozenset()
    store_port = store["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not (
        reachable_ports(policy, store_pod, who["monitoring"])
        & {int(a.split("=")[1]) for a in store_port if a.startswith("--port=")}
    )


def test_metrics_from_never_opens_a_store_port() -> None:
    spec = pool_spec(networkPolicy={"metricsFrom": [SCRAPER]}, store={"segmentSize": "1GB", "port": 9003})
    plan = build_plan("pool", NAMESPACE, spec)
    if not plan.valid:
        return  # rejecting the clash is a fix too
    objects = {f"{c['kind']}/{c['metadata']['name']}": c for c in plan.children}
    policy = objects["NetworkPolicy/pool-kvpool"]
    store_pod = pod_of(objects["Deployment/pool-store"])
    assert 9003 not in reachable_ports(policy, store_pod, peers("pool", MONITORING)["monitoring"])


def test_the_master_metrics_port_is_an_admin_port() -> None:
    """Why the policy matters: a real master lists every key and buffer address on that port."""
    pool = LocalPool(segment_size="16MB")
    with pool:
        assert pool.master is not None
        client = open_client(
            ConnectorSettings.parse({"master_server_address": pool.address}), global_segment_size=0
        )
        try:
            assert put_bytes(client, "kvpool-fp-0-0-0-abc", b"x" * 64) == 0
            base = f"http://127.0.0.1:{pool.master.metrics_port}"
            with urllib.request.urlopen(f"{base}/get_all_keys", timeout=5) as response:
                assert "kvpool-fp-0-0-0-abc" in response.read().decode()
            with urllib.request.urlopen(f"{base}/query_key?key=kvpool-fp-0-0-0-abc", timeout=5) as response:
                assert "buffer_address" in response.read().decode()
        finally:
            client.close()
    for part in (pool.master, pool.store):  # LocalPool leaves its log directories behind
        if part is not None:
            shutil.rmtree(part.log_dir, ignore_errors=True)


@pytest.mark.parametrize("case", sorted(SPECS))
@pytest.mark.parametrize("protocol", ["tcp", "rdma"])
def test_pool_pods_run_non_root_and_unprivileged(case: str, protocol: str) -> None:
    spec = dict(SPECS[case])
    spec["store"] = {
        **spec["store"],
        "protocol": protocol,
        "rdmaDevices": ["mlx5_0"] if protocol == "rdma" else [],
    }
    for name, obj in children(spec).items():
        if obj["kind"] != "Deployment":
            continue
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0, (
            name
        )
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["runAsNonRoot"] is True and not context.get("privileged"), name
            assert context["allowPrivilegeEscalation"] is False
            assert context["readOnlyRootFilesystem"] is True
            assert context["capabilities"]["drop"] == ["ALL"]
            added = set(context["capabilities"].get("add", []))
            assert added <= ({"IPC_LOCK"} if protocol == "rdma" and name.endswith("store") else set()), name
