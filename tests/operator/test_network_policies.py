"""The pool's NetworkPolicies never widen access: checked against a NetworkPolicy model
(``network_policy_model``) in a namespace that is open and in one that denies by default,
with network plugins that read ``endPort`` and ones that do not.

Rule: for every source pod, every pod that existed before the pool (its consumers
included) and every port, what the namespace admits with the pool's policies it admitted
without them. Where protection applies, the consumers' transfer ports admit only the pool's
pods, and no other port of a consumer is cut off.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.operator import names
from kvpool.operator.names import NETWORK_POLICIES
from kvpool.operator.network import (
    TRANSFER_PORT_MAX,
    TRANSFER_PORT_MIN,
    NamespaceNetwork,
    consumers_network_policy,
    guarding_policies,
    read_namespace_network,
)
from kvpool.operator.plan import build_plan
from kvpool.operator.policy import OperatorPolicy
from testing.kube_api import NAMESPACE, Cluster, eventually
from testing.operator_objects import Operator, converge, pool_manifest, pool_spec, vllm_deployment
from tests.operator.network_policy_model import Cluster as Network
from tests.operator.network_policy_model import Pod

OTHER = "other-team"
NAMESPACES = {ns: {"kubernetes.io/metadata.name": ns} for ns in (NAMESPACE, OTHER)}
POOL_UID = "uid-of-the-pool"
CONSUMER = Pod("llm-0", NAMESPACE, {"app": "llm", names.LABEL_POOL: "pool"})
GATEWAY = Pod("gateway-0", NAMESPACE, {"app": "gateway"})
NEIGHBOUR = Pod("batch-0", NAMESPACE, {"app": "batch"})
OUTSIDER = Pod("scanner-0", OTHER, {"app": "scanner"})
MASTER = Pod("pool-master-0", NAMESPACE, names.selector("pool", names.MASTER))
STORE = Pod("pool-store-0", NAMESPACE, names.selector("pool", names.STORE))
ETCD = Pod("etcd-0", NAMESPACE, {"app": "etcd", "role": "kv-metadata"})  # the tenant's, named by the pool
SOURCES = (CONSUMER, GATEWAY, NEIGHBOUR, OUTSIDER, MASTER, STORE, ETCD)
TENANT_PODS = (CONSUMER, GATEWAY, NEIGHBOUR, ETCD)  # pods that were there before the pool
HA = {
    "replicas": 2,
    "ha": {"enabled": True, "etcdEndpoints": ["etcd-0.etcd:2379"], "etcdPodSelector": {"app": "etcd"}},
}
TRANSFER = (TRANSFER_PORT_MIN, 16000, TRANSFER_PORT_MAX)
OTHER_PORTS = ((8000, "TCP"), (1, "TCP"), (TRANSFER_PORT_MIN - 1, "TCP"), (TRANSFER_PORT_MAX + 1, "TCP"),
               (65535, "TCP"), (53, "UDP"), (9, "SCTP"), (2379, "TCP"), (2380, "TCP"))  # fmt: skip
PORTS = tuple((port, "TCP") for port in TRANSFER) + OTHER_PORTS


def admin_policy(name: str, selector: dict[str, Any], ingress: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"podSelector": selector, "policyTypes": ["Ingress"], "ingress": ingress},
    }


DEFAULT_DENY = admin_policy("default-deny", {}, [])
GATEWAY_ONLY = admin_policy(
    "llm-from-gateway",
    {"matchLabels": {"app": "llm"}},
    [{"from": [{"podSelector": {"matchLabels": {"app": "gateway"}}}], "ports": [{"port": 8000}]}],
)
EGRESS_ONLY = {**admin_policy("egress", {}, []), "spec": {"podSelector": {}, "policyTypes": ["Egress"]}}
KINDS = {
    "open": (),
    "open, egress rules only": (EGRESS_ONLY,),
    "default-deny": (DEFAULT_DENY, GATEWAY_ONLY),
    "gateway policy only": (GATEWAY_ONLY,),
}


def rendered(
    admin: tuple[dict[str, Any], ...], end_port: bool, ha: bool = False
) -> tuple[list[dict[str, Any]], list[str]]:
    """The pool's NetworkPolicies (and its warnings' rules) in a namespace with ``admin``."""
    network = NamespaceNetwork(
        guarding_policies(admin, [dict(CONSUMER.labels)], POOL_UID),
        guarding_policies(admin, [dict(ETCD.labels)], POOL_UID),
    )
    spec = pool_spec(master=HA) if ha else pool_spec()
    plan = build_plan("pool", NAMESPACE, spec, OperatorPolicy(network_policy_end_port=end_port), network)
    assert plan.valid, plan.problems
    policies = [c for c in plan.children if c["kind"] == "NetworkPolicy"]
    return policies, [w.rule for w in plan.warnings]


def widened(before: Network, after: Network) -> list[str]:
    return [
        f"{source.name} -> {target.name}:{port}/{protocol}"
        for source in SOURCES
        for target in TENANT_PODS
        for port, protocol in PORTS
        if after.admits(source, target, port, protocol) and not before.admits(source, target, port, protocol)
    ]


@pytest.mark.parametrize("ha", [False, True], ids=["single master", "HA on the tenant's etcd"])
@pytest.mark.parametrize("end_port", [True, False], ids=["endPort", "no endPort"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_pools_policies_never_widen_access(kind: str, end_port: bool, ha: bool) -> None:
    admin = KINDS[kind]
    policies, _ = rendered(admin, end_port, ha)
    before = Network(NAMESPACES, admin, end_port)
    after = before.with_policies(policies)
    assert widened(before, after) == []
    # ...and cut off no port of the tenant's pods but the consumers' transfer ports (etcd pods
    # named by the pool are kept to the pool's pods and their members: what the author asked).
    cut = [
        f"{source.name} -> {target.name}:{port}/{protocol}"
        for source in SOURCES
        for target in (CONSUMER, GATEWAY, NEIGHBOUR)
        for port, protocol in OTHER_PORTS
        if before.admits(source, target, port, protocol) and not after.admits(source, target, port, protocol)
    ]
    assert cut == []


def test_an_open_namespace_keeps_the_transfer_ports_to_the_pool() -> None:
    policies, warnings = rendered((), end_port=True)
    assert warnings == []
    after = Network(NAMESPACES, (), True).with_policies(policies)
    for port in TRANSFER:
        assert after.admits(MASTER, CONSUMER, port) and after.admits(STORE, CONSUMER, port)
        for outsider in (GATEWAY, NEIGHBOUR, OUTSIDER):
            assert not after.admits(outsider, CONSUMER, port), (outsider.name, port)
    # The masters and stores admit the pool's pods only (the scraper and operator rules aside).
    assert not after.admits(NEIGHBOUR, MASTER, 9003) and after.admits(CONSUMER, MASTER, 50051)


@pytest.mark.parametrize(
    ("kind", "end_port", "rule"),
    [
        ("open", False, "consumers-no-end-port"),
        ("default-deny", True, "consumers-namespace-policy"),
        ("gateway policy only", True, "consumers-namespace-policy"),
    ],
)
def test_where_protection_would_widen_there_is_none_and_the_pool_says_so(
    kind: str, end_port: bool, rule: str
) -> None:
    policies, warnings = rendered(KINDS[kind], end_port)
    assert names.consumers_network_policy_name("pool") not in {p["metadata"]["name"] for p in policies}
    assert warnings == [rule]


def test_etcd_pods_get_a_policy_only_where_none_of_the_namespaces_selects_them() -> None:
    policies, warnings = rendered((), True, ha=True)
    assert names.etcd_network_policy_name("pool") in {p["metadata"]["name"] for p in policies}
    after = Network(NAMESPACES, (), True).with_policies(policies)
    assert after.admits(MASTER, ETCD, 2379) and not after.admits(OUTSIDER, ETCD, 2379)
    policies, warnings = rendered(KINDS["default-deny"], True, ha=True)
    assert names.etcd_network_policy_name("pool") not in {p["metadata"]["name"] for p in policies}
    assert warnings == ["consumers-namespace-policy", "etcd-namespace-policy"]


def test_the_model_bites_the_unconditional_consumer_policy() -> None:
    """The policy the operator used to add everywhere: in a default-deny namespace it opens
    vLLM's API to every pod of the cluster; on a plugin without endPort it cuts it off."""
    unconditional = consumers_network_policy("pool", NAMESPACE)
    guarded = Network(NAMESPACES, KINDS["default-deny"], True)
    assert "scanner-0 -> llm-0:8000/TCP" in widened(guarded, guarded.with_policies([unconditional]))
    open_without_end_port = Network(NAMESPACES, (), False).with_policies([unconditional])
    assert not open_without_end_port.admits(GATEWAY, CONSUMER, 8000)


NETPOL = "networking.k8s.io/v1/networkpolicies"


@pytest.mark.asyncio
async def test_the_operator_follows_the_namespaces_policies(cluster: Cluster, operator: Operator) -> None:
    """A default-deny in the pool's namespace: the operator adds no consumer policy and says
    why; once it is gone, the consumers' policy protects their transfer ports."""
    await cluster.create(vllm_deployment())
    await cluster.create(DEFAULT_DENY)
    await cluster.create(pool_manifest())
    status = await converge(cluster, generation=1)
    (warning,) = status["warnings"]
    assert "default-deny" in warning and warning.endswith("[consumers-namespace-policy]")
    assert cluster.get(NETPOL, "pool-consumers") is None
    assert cluster.get(NETPOL, "pool-kvpool") is not None

    response = await cluster.api.delete(NETWORK_POLICIES.path(NAMESPACE, "default-deny"))
    assert response.status == 200
    await eventually(lambda: cluster.get(NETPOL, "pool-consumers") is not None, what="consumers' policy")
    await eventually(lambda: cluster.pool_status("pool").get("warnings") in (None, []), what="warning gone")


class FakeKube:
    """Answers ``list`` and ``get`` from fixed objects, recording the label selectors asked."""

    def __init__(self, objects: dict[str, list[dict[str, Any]]]):
        self.objects = objects
        self.selectors: list[str | None] = []

    async def list(self, resource: Any, namespace: str, label_selector: str | None = None) -> list[dict]:
        self.selectors.append(label_selector)
        return list(self.objects.get(resource.plural, []))

    async def get(self, resource: Any, namespace: str, name: str) -> dict[str, Any] | None:
        found = [o for o in self.objects.get(resource.plural, []) if o["metadata"]["name"] == name]
        return found[0] if found else None


@pytest.mark.asyncio
async def test_the_namespace_is_read_with_the_consumers_and_etcd_pods_labels() -> None:
    pool = pool_manifest(spec=pool_spec(master=HA))
    pool["metadata"]["uid"] = POOL_UID
    own = admin_policy("pool-consumers", {}, [])
    own["metadata"]["ownerReferences"] = [{"uid": POOL_UID}]
    etcd_only = admin_policy("etcd-from-backup", {"matchLabels": {"role": "kv-metadata"}}, [])
    kube = FakeKube(
        {
            "networkpolicies": [own, etcd_only, GATEWAY_ONLY],
            "deployments": [vllm_deployment()],
            "pods": [{"metadata": {"name": "etcd-0", "labels": dict(ETCD.labels)}}],
        }
    )
    network = await read_namespace_network(kube, pool)  # type: ignore[arg-type]
    # The pool's own policy never counts; the gateway policy selects the consumer's pods ("app: llm"
    # from its pod template); the backup policy selects etcd by a label the selector does not name.
    assert network == NamespaceNetwork(("llm-from-gateway",), ("etcd-from-backup",))
    assert "app=etcd" in kube.selectors
    only_own = FakeKube({"networkpolicies": [own]})
    assert await read_namespace_network(only_own, pool) == NamespaceNetwork()  # type: ignore[arg-type]


def test_a_selector_the_operator_cannot_read_counts_as_selecting() -> None:
    odd = admin_policy("odd", {"matchExpressions": [{"key": "app", "operator": "Gt", "values": ["1"]}]}, [])
    assert guarding_policies([odd], [dict(CONSUMER.labels)], POOL_UID) == ("odd",)
    assert guarding_policies([GATEWAY_ONLY], [{"app": "batch"}], POOL_UID) == ()


def test_a_same_named_pool_never_takes_another_namespaces_consumers_for_its_own() -> None:
    """OTHER's consumer of this namespace's pool carries ``pool=pool``; a pool of OTHER also
    named ``pool`` must neither select it (its policy would widen OTHER's gateway-only rule
    for it) nor admit it to its masters and stores as one of its own pods."""
    gateway_only = {**GATEWAY_ONLY, "metadata": {"name": "llm-from-gateway", "namespace": OTHER}}
    granted = Pod(
        "tenant-llm-0", OTHER, {"app": "llm", names.LABEL_POOL: "pool", names.LABEL_POOL_NAMESPACE: NAMESPACE}
    )
    # OTHER's own pool sees no policy of OTHER selecting its own consumers (not "app: llm").
    plan = build_plan("pool", OTHER, pool_spec(), OperatorPolicy(), NamespaceNetwork())
    assert plan.valid, plan.problems
    before = Network(NAMESPACES, (gateway_only,))
    after = before.with_policies(c for c in plan.children if c["kind"] == "NetworkPolicy")
    assert names.consumers_network_policy_name("pool") in {p["metadata"]["name"] for p in after.policies}
    for source in SOURCES:
        for port, protocol in PORTS:
            assert after.admits(source, granted, port, protocol) == before.admits(
                source, granted, port, protocol
            )
    theirs = Pod("pool-master-0", OTHER, names.selector("pool", names.MASTER))
    assert not after.admits(granted, theirs, 9003) and not after.admits(granted, theirs, 50051)
    own = Pod("llm-0", OTHER, {"app": "llm", names.LABEL_POOL: "pool"})
    assert after.admits(own, theirs, 50051)


def test_consumers_in_the_granted_namespaces_reach_rpc_and_transfer_ports_only() -> None:
    third = "third-team"
    namespaces = {**NAMESPACES, third: {"kubernetes.io/metadata.name": third}}
    spec = pool_spec(tenancy={"enabled": True, "grantNamespaces": [OTHER]}, consumers=[])
    plan = build_plan("pool", NAMESPACE, spec, OperatorPolicy())
    assert plan.valid, plan.problems
    network = Network(namespaces, ()).with_policies(c for c in plan.children if c["kind"] == "NetworkPolicy")
    labels = {names.LABEL_POOL: "pool", names.LABEL_POOL_NAMESPACE: NAMESPACE}
    granted = Pod("tenant-llm-0", OTHER, labels)
    for port in (50051, *TRANSFER):
        assert network.admits(granted, MASTER if port == 50051 else STORE, port), port
    # Never the admin API, nor another port; never a pod without both labels or elsewhere.
    assert not network.admits(granted, MASTER, 9003) and not network.admits(granted, STORE, 50052)
    for stranger in (
        Pod("tenant-batch-0", OTHER, {"app": "batch"}),
        Pod("tenant-llm-1", OTHER, {names.LABEL_POOL: "pool"}),
        Pod("tenant-llm-2", OTHER, {names.LABEL_POOL: "pool", names.LABEL_POOL_NAMESPACE: "elsewhere"}),
        Pod("stranger-0", third, labels),
    ):
        assert not network.admits(stranger, MASTER, 50051) and not network.admits(stranger, STORE, 15000), (
            stranger
        )
    # Without grantNamespaces the rule is not there: the granted pod is a stranger too.
    plain = build_plan(
        "pool", NAMESPACE, pool_spec(tenancy={"enabled": True}, consumers=[]), OperatorPolicy()
    )
    closed = Network(namespaces, ()).with_policies(c for c in plain.children if c["kind"] == "NetworkPolicy")
    assert not closed.admits(granted, MASTER, 50051) and not closed.admits(granted, STORE, 15000)


def test_granted_consumers_reach_the_etcd_pods_an_ha_pool_names() -> None:
    """They find the leader in etcd too: its client ports, and nothing else of it."""
    spec = pool_spec(master=HA, tenancy={"enabled": True, "grantNamespaces": [OTHER]}, consumers=[])
    plan = build_plan("pool", NAMESPACE, spec, OperatorPolicy())
    assert plan.valid, plan.problems
    network = Network(NAMESPACES, ()).with_policies(c for c in plan.children if c["kind"] == "NetworkPolicy")
    granted = Pod("tenant-llm-0", OTHER, {names.LABEL_POOL: "pool", names.LABEL_POOL_NAMESPACE: NAMESPACE})
    assert network.admits(granted, ETCD, 2379) and not network.admits(granted, ETCD, 2380)
    assert not network.admits(Pod("tenant-batch-0", OTHER, {"app": "batch"}), ETCD, 2379)
    assert not network.admits(OUTSIDER, ETCD, 2379) and network.admits(MASTER, ETCD, 2379)
