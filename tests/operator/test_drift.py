"""Hand edits of what the operator owns are put back; a pool whose NetworkPolicy cannot be
applied does not start its master and store (fail closed)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.operator import names
from testing.kube_api import DEPLOYMENTS_PATH, NAMESPACE, Cluster, eventually
from testing.operator_objects import Operator, converge, pool_manifest, vllm_deployment

pytestmark = pytest.mark.asyncio
NETPOL = "networking.k8s.io/v1/networkpolicies"
PDBS = "policy/v1/poddisruptionbudgets"


async def edit(cluster: Cluster, path: str, patch: dict[str, Any]) -> None:
    """Someone else's merge patch (kubectl scale, kubectl edit)."""
    response = await cluster.api.patch(
        path, json=patch, headers={"Content-Type": "application/merge-patch+json"}
    )
    assert response.status == 200, await response.text()


def replicas(cluster: Cluster, deployment: str) -> int | None:
    return (cluster.get(DEPLOYMENTS_PATH, deployment) or {}).get("spec", {}).get("replicas")


def foreign_policy() -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "pool-kvpool", "namespace": NAMESPACE, "labels": {"team": "web"}},
        "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"], "ingress": [{}]},
    }


async def test_hand_edits_of_owned_fields_are_put_back(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest())
    await converge(cluster, generation=1)
    policy = cluster.get(NETPOL, "pool-kvpool")
    assert policy is not None

    # kubectl scale deployment pool-store --replicas=0
    await edit(
        cluster, f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/pool-store", {"spec": {"replicas": 0}}
    )
    await eventually(lambda: replicas(cluster, "pool-store") == 2, what="the store scaled back")
    (event,) = await eventually(lambda: cluster.events("DriftCorrected"), what="an Event")
    assert event["type"] == "Warning" and "Deployment/pool-store: spec.replicas" in event["message"]

    # kubectl edit networkpolicy pool-kvpool: a rule that lets everyone in, and a narrower selector.
    wider = {"spec": {"ingress": [*policy["spec"]["ingress"], {}]}}
    await edit(
        cluster, f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies/pool-kvpool", wider
    )
    await eventually(
        lambda: cluster.get(NETPOL, "pool-kvpool")["spec"] == policy["spec"],
        what="the policy's rules put back",
    )
    narrower = {"spec": {"podSelector": {"matchLabels": {"extra": "label"}}}}
    await edit(
        cluster, f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies/pool-kvpool", narrower
    )
    await eventually(
        lambda: cluster.get(NETPOL, "pool-kvpool")["spec"] == policy["spec"],
        what="the policy's selector put back",
    )

    # The single master's disruption budget loosened by hand: back to no voluntary eviction.
    loosened = {"spec": {"maxUnavailable": None, "minAvailable": 0}}
    await edit(cluster, f"/apis/policy/v1/namespaces/{NAMESPACE}/poddisruptionbudgets/pool-master", loosened)
    await eventually(
        lambda: (
            (cluster.get(PDBS, "pool-master") or {}).get("spec", {}).get("maxUnavailable") == 0
            and "minAvailable" not in cluster.get(PDBS, "pool-master")["spec"]
        ),
        what="the budget put back",
    )

    # kubectl edit: the single master's strategy made RollingUpdate (the server defaults its
    # rollingUpdate). Recreate comes back without it: a real server refuses both together (422).
    rolling = {"spec": {"strategy": {"type": "RollingUpdate"}}}
    await edit(cluster, f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/pool-master", rolling)
    await eventually(
        lambda: cluster.get(DEPLOYMENTS_PATH, "pool-master")["spec"]["strategy"] == {"type": "Recreate"},
        what="the master's Recreate strategy put back",
    )

    # What others add beside the operator's fields stays (an annotation, a restart stamp).
    restarted = {
        "spec": {"template": {"metadata": {"annotations": {"kubectl.kubernetes.io/restartedAt": "now"}}}}
    }
    await edit(cluster, f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/pool-master", restarted)
    await converge(cluster, generation=1)
    await cluster.quiet("pool")
    master = cluster.get(DEPLOYMENTS_PATH, "pool-master")
    assert master["spec"]["template"]["metadata"]["annotations"] == {
        "kubectl.kubernetes.io/restartedAt": "now"
    }


async def test_a_taken_policy_name_keeps_master_and_store_stopped(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create(foreign_policy())
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest())

    master_ready = await eventually(
        lambda: (
            cluster.condition("pool", "MasterReady").get("reason") == "NotProtected"
            and cluster.condition("pool", "MasterReady")
        ),
        what="MasterReady=False NotProtected",
    )
    assert master_ready["status"] == "False"
    assert cluster.condition("pool", "StoreReady")["reason"] == "NotProtected"
    assert (
        "NetworkPolicy team-a/pool-kvpool exists and is not this pool's"
        in cluster.condition("pool", "Conflict")["message"]
    )
    (event,) = await eventually(lambda: cluster.events("NotStarted"), what="a NotStarted Event")
    assert event["type"] == "Warning" and "NetworkPolicy" in event["message"]
    cluster.settle()
    await cluster.passes("pool", cluster.mark(), count=2)
    assert replicas(cluster, "pool-master") == 0 and replicas(cluster, "pool-store") == 0
    assert names.LABEL_CONSUMER_OF not in cluster.get(DEPLOYMENTS_PATH, "llm")["metadata"]["labels"]
    assert cluster.get(NETPOL, "pool-kvpool")["metadata"]["labels"] == {"team": "web"}

    # The name is free again: the pool's own policy first, then master and store start.
    response = await cluster.api.delete(
        f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies/pool-kvpool"
    )
    assert response.status == 200
    await converge(cluster, generation=1)
    assert replicas(cluster, "pool-master") == 1 and replicas(cluster, "pool-store") == 2
    assert cluster.get(NETPOL, "pool-kvpool")["metadata"]["labels"][names.LABEL_POOL] == "pool"
