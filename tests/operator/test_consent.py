"""A consumer Deployment is patched only with its owner's consent (the label
``kvpool.mooncake.io/allow-pool: <pool>``); never another pool's consumer, never an object
the operator manages. Every refusal: a condition and an Event naming the Deployment and
the rule, and no write."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.operator import names
from kvpool.operator.consumers import refusal
from testing.kube_api import DEPLOYMENTS_PATH, NAMESPACE, Cluster, eventually
from testing.operator_objects import (
    Operator,
    consumer,
    converge,
    kv_flags,
    pool_manifest,
    pool_spec,
    vllm_deployment,
)

pytestmark = pytest.mark.asyncio


def deployment_url(name: str) -> str:
    return f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}"


def writes_to(cluster: Cluster, name: str, start: int = 0) -> list[str]:
    return [f"{r.method} {r.url.path}" for r in cluster.writes(start) if r.url.path == deployment_url(name)]


def operator_deployment() -> dict[str, Any]:
    """The operator's own Deployment as the chart labels it, even carrying the consent label."""
    deployment = vllm_deployment("kvpool-operator")
    deployment["metadata"]["labels"].update(
        {"app.kubernetes.io/part-of": "mooncake-kvpool", "app.kubernetes.io/component": "operator"}
    )
    return deployment


async def refused(cluster: Cluster, pool: str, deployment: str) -> str:
    """The pool's refusal of ``deployment``, once it names it."""

    def named() -> str | None:
        condition = cluster.condition(pool, "Conflict")
        parts = [p for p in condition.get("message", "").split("; ") if f"/{deployment} " in p]
        return parts[0] if condition.get("status") == "True" and parts else None

    return str(await eventually(named, what=f"{pool} refuses {deployment}"))


async def test_only_consenting_deployments_are_patched(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(vllm_deployment("llm", allow_pool=None))
    await cluster.create(vllm_deployment("chat", allow_pool="other"))
    await cluster.create(operator_deployment())
    consumers = [consumer("llm"), consumer("chat"), consumer("kvpool-operator"), consumer("pool-master")]
    await cluster.create(pool_manifest(spec=pool_spec(consumers=consumers)))

    no_label = await refused(cluster, "pool", "llm")
    assert no_label == (
        "Deployment team-a/llm needs the label kvpool.mooncake.io/allow-pool=pool to take its settings "
        "(has no such label) [consent]"
    )
    other = await refused(cluster, "pool", "chat")
    assert "allows pool 'other'" in other and other.endswith("[consent]")
    for managed in ("kvpool-operator", "pool-master"):  # the operator itself; the pool's own master
        message = await refused(cluster, "pool", managed)
        assert (
            message
            == f"Deployment team-a/{managed} is managed by the operator, never a consumer [operator-managed]"
        )
    events = await eventually(
        lambda: len(cluster.events("ConsumerRefused")) == 4 and cluster.events("ConsumerRefused")
    )
    assert {e["message"] for e in events} == set(cluster.condition("pool", "Conflict")["message"].split("; "))
    status = cluster.pool_status("pool")
    assert status["phase"] == "Conflict"
    assert {c["name"]: c["rolledOut"] for c in status["consumers"]} == dict.fromkeys(
        ("llm", "chat", "kvpool-operator", "pool-master"), False
    )
    for name in ("llm", "chat", "kvpool-operator"):
        assert writes_to(cluster, name) == [], name
    assert writes_to(cluster, "pool-master") == []  # created by a POST to the collection, never patched

    # The owner of "llm" consents: it gets the settings, the others stay refused.
    start = cluster.mark()
    response = await cluster.api.patch(
        deployment_url("llm"),
        json={"metadata": {"labels": {names.LABEL_ALLOW_POOL: "pool"}}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert response.status == 200
    # (once the pool serves: consumers are rolled only onto a pool whose master and store are available)
    await eventually(
        lambda: cluster.settle() or len(kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm"))) == 1,
        what="llm injected",
    )
    assert writes_to(cluster, "chat", start) == writes_to(cluster, "kvpool-operator", start) == []


async def test_two_pools_naming_one_consumer_never_fight(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(vllm_deployment("llm", allow_pool="first"))
    await cluster.create(pool_manifest("first", pool_spec(consumers=[consumer("llm")])))
    await converge(cluster, "first", generation=1)
    await cluster.create(pool_manifest("second", pool_spec(consumers=[consumer("llm")])))
    message = await refused(cluster, "second", "llm")
    assert message == "Deployment team-a/llm carries pool 'first''s connector settings [other-pool]"
    await converge(cluster, "first")
    # Settled: passes over both pools write nothing to the consumer (no flip-flop, no rollouts).
    await eventually(lambda: cluster.handled("second"), what="kopf is done with the second pool")
    start = cluster.mark()
    end = await cluster.passes("second", start, count=3)
    await cluster.passes("first", start, count=3)
    assert [r for r in cluster.writes(start, end) if "/deployments/" in r.url.path] == []
    assert len(cluster.events("ConsumerRefused")) == 1

    # The owner moves the consent to the second pool: the first stops writing to it, the
    # second waits until the first lets go of it; then it takes it.
    response = await cluster.api.patch(
        deployment_url("llm"),
        json={"metadata": {"labels": {names.LABEL_ALLOW_POOL: "second"}}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert response.status == 200
    assert "allows pool 'second'" in await refused(cluster, "first", "llm")
    await cluster.patch_pool("first", {"spec": {"consumers": []}})
    await eventually(
        lambda: (
            (cluster.get(DEPLOYMENTS_PATH, "llm") or {})
            .get("metadata", {})
            .get("labels", {})
            .get(names.LABEL_CONSUMER_OF)
            == "second"
        ),
        what="the second pool takes the consumer",
    )
    await converge(cluster, "second")


async def test_refusal_rules() -> None:
    def deployment(labels: dict[str, str], owners: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": "d", "namespace": "ns", "labels": labels}
        if owners:
            meta["ownerReferences"] = owners
        return {"metadata": meta}

    allow = {names.LABEL_ALLOW_POOL: "p"}
    assert refusal(deployment(allow), "p") is None
    assert refusal(deployment({**allow, names.LABEL_CONSUMER_OF: "p"}), "p") is None
    rules = {
        "no label": (deployment({}), "consent"),
        "other pool allowed": (deployment({names.LABEL_ALLOW_POOL: "q"}), "consent"),
        "other pool's settings": (deployment({**allow, names.LABEL_CONSUMER_OF: "q"}), "other-pool"),
        "part of the project": (
            deployment({**allow, names.LABEL_PART_OF: names.PART_OF}),
            "operator-managed",
        ),
        "a pool component": (deployment({**allow, names.LABEL_COMPONENT: "store"}), "operator-managed"),
        "owned by a pool": (
            deployment(allow, [{"apiVersion": "kvpool.mooncake.io/v1alpha1", "kind": "MooncakeKVPool"}]),
            "operator-managed",
        ),
    }
    for case, (obj, rule) in rules.items():
        found = refusal(obj, "p")
        assert found is not None and found.rule == rule, case
        assert "Deployment ns/d" in str(found) and str(found).endswith(f"[{rule}]"), case
