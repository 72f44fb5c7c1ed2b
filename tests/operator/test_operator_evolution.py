"""A pool's spec evolving through every kind of change, and the RBAC rules it needs."""

from __future__ import annotations

import pytest

from kvpool.operator.names import GRANTS
from kvpool.operator.policy import OperatorPolicy
from kvpool.operator.rbac import RULES, implied_permissions, request_permission
from testing.kube_api import (
    DEPLOYMENTS_PATH,
    GRANTS_PATH,
    NAMESPACE,
    POOLS_PATH,
    Cluster,
    eventually,
)
from testing.operator_objects import (
    Operator,
    as_created,
    consumer,
    converge,
    kv_flags,
    pool_manifest,
    template,
    vllm_deployment,
)

pytestmark = pytest.mark.asyncio
NETPOL = "networking.k8s.io/v1/networkpolicies"
PDBS = "policy/v1/poddisruptionbudgets"
SCRAPER = {"namespaceSelector": {"team": "monitoring"}, "podSelector": {"app": "prometheus"}}


# The admin lets pools run without their NetworkPolicy (off by default: policy-required).
@pytest.mark.parametrize("operator_config", [{"policy": OperatorPolicy(allow_network_policy_opt_out=True)}])
async def test_every_change_converges_and_uses_every_rule(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest())
    await converge(cluster, generation=1)

    # A new RPC port: Service, master, ConfigMap and the consumer follow.
    await cluster.patch_pool(
        "pool",
        {"spec": {"master": {"rpcPort": 50100}, "networkPolicy": {"metricsFrom": [SCRAPER]}}},
    )
    status = await converge(cluster, generation=2)
    assert status["masterAddress"] == f"pool-master.{NAMESPACE}.svc:50100"
    service = cluster.get("v1/services", "pool-master")
    assert service is not None and service["spec"]["ports"][0]["port"] == 50100
    assert "pool-master.team-a.svc:50100" in kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm"))[0]
    policy = cluster.get(NETPOL, "pool-kvpool")
    assert policy is not None and len(policy["spec"]["ingress"]) == 2

    # A child edited by hand where the operator owns it is put back: the single master's
    # PodDisruptionBudget loosened to let a drain take it.
    pdb_path = "/apis/policy/v1/namespaces/team-a/poddisruptionbudgets/pool-master"
    loosened = {"spec": {"maxUnavailable": None, "minAvailable": 0}}
    response = await cluster.api.patch(
        pdb_path, json=loosened, headers={"Content-Type": "application/merge-patch+json"}
    )
    assert response.status == 200
    await eventually(
        lambda: (
            (cluster.get(PDBS, "pool-master") or {}).get("spec", {}).get("maxUnavailable") == 0
            and "minAvailable" not in cluster.get(PDBS, "pool-master")["spec"]
        ),
        what="the PodDisruptionBudget re-applied",
    )

    # Embedded mode, no NetworkPolicy: store pods and the policy go away.
    await cluster.patch_pool(
        "pool", {"spec": {"store": {"mode": "embedded"}, "networkPolicy": {"enabled": False}}}
    )
    status = await converge(cluster, generation=3)
    assert cluster.get(DEPLOYMENTS_PATH, "pool-store") is None
    assert cluster.get(NETPOL, "pool-kvpool") is None
    assert {c["type"]: c["reason"] for c in status["conditions"]}["StoreReady"] == "Embedded"
    assert '"global_segment_size":1073741824' in kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm"))[0]

    # Tenancy: the consumer attaches to a grant of its namespace, which says its tenant.
    await cluster.create(
        {
            "apiVersion": f"{GRANTS.group}/{GRANTS.version}",
            "kind": GRANTS.kind,
            "metadata": {"name": "team", "namespace": NAMESPACE},
            "spec": {"pool": "pool", "ceiling": "1GB"},
        }
    )
    tenancy = {"tenancy": {"enabled": True}, "consumers": [{**consumer(), "grant": "team"}]}
    await cluster.patch_pool("pool", {"spec": tenancy})
    await converge(cluster, generation=4)
    await eventually(
        lambda: (
            ((cluster.get(GRANTS_PATH, "team") or {}).get("status") or {}).get("tenant")
            == f"{NAMESPACE}.team"
        ),
        what="the grant's tenant",
    )
    assert f"{NAMESPACE}.team" in kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm"))[0]

    # No consumers: the Deployment gets its own settings back.
    await cluster.patch_pool("pool", {"spec": {"consumers": []}})
    await eventually(
        lambda: template(cluster.get(DEPLOYMENTS_PATH, "llm")) == template(as_created(cluster, "llm")),
        what="consumer released",
    )
    await converge(cluster, generation=5)

    await cluster.delete_pool("pool")
    await eventually(lambda: cluster.get(POOLS_PATH, "pool") is None, what="pool gone")
    assert cluster.get("v1/configmaps", "pool-connector") is None
    assert cluster.get("v1/services", "pool-master") is None

    # Every request was allowed by RBAC (the fixture checks), and every rule was needed.
    used = {
        (p.api_group, p.resource, p.verb)
        for r in cluster.requests()
        for p in [request_permission(r.method, str(r.url)), *implied_permissions(r.method, r.data)]
        if p is not None
    }
    granted = {
        (rule.api_group, resource, verb)
        for rule in RULES
        for resource in rule.resources
        for verb in rule.verbs
    }
    # Pods are listed too: the consumers' pods, asked for their hits (test_consumer_hits.py).
    assert granted - used == set()
    assert used - granted == set()
