"""Teardown never pins a pool in Terminating: an unreadable restore record is reported and
the pool's settings are taken out all the same; an annotation lets a pool go at once."""

from __future__ import annotations

import json

import pytest

from kvpool.operator import names
from kvpool.operator.consumers import injected, record_problem, restored
from kvpool.operator.plan import build_plan
from kvpool.operator.policy import OperatorPolicy
from kvpool.operator.store_drain import later
from kvpool.operator.teardown_order import (
    GUARD_WAIT_S,
    guards,
    guards_wait,
    running_pods,
    unguarded_children,
)
from testing.kube_api import DEPLOYMENTS_PATH, NAMESPACE, POOLS_PATH, Cluster, Fault, eventually
from testing.operator_objects import (
    Operator,
    consumer,
    converge,
    kv_flags,
    pool_manifest,
    pool_pod,
    pool_spec,
    vllm_deployment,
)

NETWORK_POLICIES_PATH = "networking.k8s.io/v1/networkpolicies"

MALFORMED = json.dumps({"version": 2, "container": "vllm", "env": ["PYTHONHASHSEED"], "others": "x"})


def test_malformed_records_are_named_and_restoring_still_takes_the_settings_out() -> None:
    inj = build_plan("pool", NAMESPACE, pool_spec()).consumers[0]
    assert record_problem(None) is None
    for raw, problem in (
        ("{", "not JSON"),
        ("[]", "not a JSON object"),
        ('{"version": 1}', "version 1"),
        (MALFORMED, "'others' has the wrong type"),
        ('{"version": 2, "flags": [["args", "0", []]]}', "flag entry"),
    ):
        assert problem in str(record_problem(raw)), raw
        deployment = injected(vllm_deployment(), inj)
        deployment["metadata"]["annotations"][names.ANNOTATION_RESTORE] = raw
        back = restored(deployment)
        assert kv_flags(back) == []
        assert names.LABEL_CONSUMER_OF not in back["metadata"]["labels"]


async def corrupt_record(cluster: Cluster, deployment: str) -> None:
    response = await cluster.api.patch(
        f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{deployment}",
        json={"metadata": {"annotations": {names.ANNOTATION_RESTORE: MALFORMED}}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert response.status == 200


@pytest.mark.asyncio
async def test_a_malformed_restore_record_never_pins_the_pool(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest())
    await converge(cluster, generation=1)
    await corrupt_record(cluster, "llm")

    await cluster.delete_pool("pool")
    await eventually(lambda: cluster.get(POOLS_PATH, "pool") is None, what="pool gone")
    llm = cluster.get(DEPLOYMENTS_PATH, "llm")
    assert kv_flags(llm) == []
    assert names.LABEL_CONSUMER_OF not in llm["metadata"]["labels"]
    assert names.ANNOTATION_RESTORE not in (llm["metadata"].get("annotations") or {})
    (event,) = await eventually(lambda: cluster.events("RestoreRecordMalformed"), what="an Event")
    assert event["type"] == "Warning" and "llm" in event["message"] and "wrong type" in event["message"]


@pytest.mark.asyncio
async def test_the_skip_teardown_annotation_lets_a_stuck_pool_go(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest())
    await converge(cluster, generation=1)
    # The consumer cannot be patched, over and over: teardown keeps failing.
    cluster.api.fail(Fault("PATCH", "deployments", 500, times=10_000, name="llm"))
    await cluster.delete_pool("pool")
    await cluster.passes("pool", cluster.mark(), count=3)
    assert cluster.get(POOLS_PATH, "pool") is not None

    await cluster.patch_pool("pool", {"metadata": {"annotations": {names.ANNOTATION_SKIP_TEARDOWN: "true"}}})
    await eventually(lambda: cluster.get(POOLS_PATH, "pool") is None, what="pool gone")
    (event,) = await eventually(lambda: cluster.events("TeardownSkipped"), what="an Event")
    assert event["type"] == "Warning"
    assert kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm"))  # left as it was, as the Event says


@pytest.mark.asyncio
async def test_a_consumer_the_api_refuses_never_keeps_the_others_from_their_release(
    cluster: Cluster, operator: Operator
) -> None:
    # Listed first, so that a release stopping at the first refusal leaves "second" behind.
    for deployment in ("first", "second"):
        await cluster.create(vllm_deployment(deployment))
    await cluster.create(pool_manifest(spec=pool_spec(consumers=[consumer("first"), consumer("second")])))
    await converge(cluster, generation=1)
    assert all(kv_flags(cluster.get(DEPLOYMENTS_PATH, name)) for name in ("first", "second"))

    # The pool stops listing both; an admission webhook refuses every patch of "first".
    refusal = cluster.api.fail(Fault("PATCH", "deployments", 403, times=10_000, name="first"))
    await cluster.patch_pool("pool", {"spec": {"consumers": [consumer("other")]}})
    await eventually(lambda: cluster.pool_status("pool").get("observedGeneration") == 2, what="pass 2")
    assert kv_flags(cluster.get(DEPLOYMENTS_PATH, "second")) == []
    assert kv_flags(cluster.get(DEPLOYMENTS_PATH, "first"))
    events = await eventually(lambda: cluster.events("ConsumerNotReleased"), what="an Event")
    assert all(e["type"] == "Warning" and e["message"].startswith("first:") for e in events)

    # Teardown tries every consumer too, and keeps the pool's children while one keeps its settings.
    await cluster.patch_pool("pool", {"spec": {"consumers": [consumer("first"), consumer("second")]}})
    refusal.times = 0
    await converge(cluster, generation=3)
    refusal.times = 10_000
    await cluster.delete_pool("pool")
    await eventually(lambda: kv_flags(cluster.get(DEPLOYMENTS_PATH, "second")) == [], what="second released")
    await cluster.passes("pool", cluster.mark(), count=2)
    assert cluster.get(POOLS_PATH, "pool") is not None
    assert kv_flags(cluster.get(DEPLOYMENTS_PATH, "first"))
    assert cluster.get(DEPLOYMENTS_PATH, names.master_name("pool")) is not None

    refusal.times = 0
    await eventually(lambda: cluster.get(POOLS_PATH, "pool") is None, what="pool gone")
    assert kv_flags(cluster.get(DEPLOYMENTS_PATH, "first")) == []


@pytest.mark.asyncio
async def test_a_consumer_gone_since_the_list_is_no_refusal(cluster: Cluster, operator: Operator) -> None:
    """A 404 on the release patch (the Deployment was deleted after the list) is nothing to
    report: no Warning, and the others are released."""
    for deployment in ("first", "second"):
        await cluster.create(vllm_deployment(deployment))
    await cluster.create(pool_manifest(spec=pool_spec(consumers=[consumer("first"), consumer("second")])))
    await converge(cluster, generation=1)
    cluster.api.fail(Fault("PATCH", "deployments", 404, name="first"))
    await cluster.patch_pool("pool", {"spec": {"consumers": [consumer("other")]}})
    await eventually(lambda: kv_flags(cluster.get(DEPLOYMENTS_PATH, "second")) == [], what="second released")
    await eventually(lambda: kv_flags(cluster.get(DEPLOYMENTS_PATH, "first")) == [], what="first, next pass")
    assert cluster.events("ConsumerNotReleased") == []


def guarded_pod_lists(cluster: Cluster, start: int) -> int:
    """How many times the operator listed the pool's master pods since ``start``."""
    selector = names.label_selector("pool", names.MASTER)
    return sum(
        1
        for r in cluster.requests(start)
        if r.method.upper() == "GET"
        and r.url.path.endswith("/pods")
        and r.params.get("labelSelector") == selector
    )


@pytest.mark.asyncio
async def test_the_network_policies_go_last_once_the_pools_pods_are_gone(
    cluster: Cluster, operator: Operator
) -> None:
    """Deleting the master and store Deployments only starts their pods' end: the policies that
    keep the cluster from the master's admin port and the stores' memory stay until those pods
    are gone, and the pool (its finalizer) with them."""
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest())
    await converge(cluster, generation=1)
    policy = names.network_policy_name("pool")
    assert cluster.get(NETWORK_POLICIES_PATH, policy) is not None
    # The pods the ReplicaSet controller made (the emulated API runs none), one terminating
    # within its grace period.
    await cluster.create(pool_pod("pool-master-0", "10.0.0.1", names.MASTER))
    await cluster.create(pool_pod("pool-store-0", "10.0.0.2", names.STORE))

    start = cluster.mark()
    await cluster.delete_pool("pool")
    await eventually(
        lambda: cluster.get(POOLS_PATH, "pool") is None or guarded_pod_lists(cluster, start) >= 2,
        what="the pool gone, or its teardown tried twice",
    )
    assert cluster.get(POOLS_PATH, "pool") is not None, "the pool went while its pods may still run"
    assert cluster.get(NETWORK_POLICIES_PATH, policy) is not None
    assert cluster.get(DEPLOYMENTS_PATH, "pool-master") is None  # the rest is gone already
    assert kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm")) == []

    await cluster.delete_pod("pool-master-0")
    await cluster.delete_pod("pool-store-0")
    await eventually(lambda: cluster.get(POOLS_PATH, "pool") is None, what="pool gone")
    assert cluster.get(NETWORK_POLICIES_PATH, policy) is None
    assert cluster.events("GuardsRemoved") == []


@pytest.mark.parametrize("operator_config", [{"policy": OperatorPolicy(allow_network_policy_opt_out=True)}])
@pytest.mark.asyncio
async def test_a_pool_without_network_policies_waits_for_no_pod(cluster: Cluster, operator: Operator) -> None:
    """A pool whose NetworkPolicies are off has nothing to delete last: its teardown ends
    with its other children deleted, its pods still in their grace period, not after a wait
    for them to end (up to ``GUARD_WAIT_S`` for a pod on a node that does not answer)."""
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest(spec=pool_spec(networkPolicy={"enabled": False})))
    # Without policies the operator asks the pool's master (the unserved test URL) a second
    # after the pool appears: its phase turns Error then, so this waits for the pool applied,
    # not for Ready (which a loaded machine may never see before the first poll).
    await eventually(lambda: applied(cluster), what="the pool applied")
    assert cluster.get(NETWORK_POLICIES_PATH, names.network_policy_name("pool")) is None
    await cluster.create(pool_pod("pool-master-0", "10.0.0.1", names.MASTER))
    await cluster.create(pool_pod("pool-store-0", "10.0.0.2", names.STORE))

    await cluster.delete_pool("pool")
    await eventually(lambda: cluster.get(POOLS_PATH, "pool") is None, what="pool gone")
    assert cluster.get(DEPLOYMENTS_PATH, "pool-master") is None
    assert kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm")) == []


def applied(cluster: Cluster) -> bool:
    """The pool's spec handled, its master and stores rolled out (the Deployment controller played)."""
    cluster.settle()
    ready = [cluster.condition("pool", kind).get("status") for kind in ("MasterReady", "StoreReady")]
    return cluster.handled("pool") and ready == ["True", "True"]


def test_pods_past_their_grace_period_or_ended_keep_no_policy_and_the_wait_has_a_deadline() -> None:
    now = "2026-12-06T10:00:00Z"
    pods = [
        pool_pod("running", "10.0.0.1", names.MASTER),
        pool_pod("ended", "10.0.0.2", names.STORE, phase="Failed"),
        {"metadata": {"name": "in-grace", "deletionTimestamp": "2026-12-06T10:00:20Z"}},
        {"metadata": {"name": "past-grace", "deletionTimestamp": "2026-12-06T09:59:59Z"}},
    ]
    running = running_pods(pods, now)
    assert running == ["in-grace", "running"]
    assert guards_wait(running, "2026-12-06T09:56:00Z", now)
    assert not guards_wait(running, later(now, -GUARD_WAIT_S), now)
    assert not guards_wait([], now, now)
    assert {resource.plural for resource, _ in guards("pool")} == {"networkpolicies"}
    assert all(resource.plural != "networkpolicies" for resource, _ in unguarded_children("pool"))
