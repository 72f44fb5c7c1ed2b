"""Consumers are rolled only onto a pool that serves, one Deployment at a time, and the rollout
stops at the first Deployment that does not become available."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.operator import names
from testing.kube_api import _SEQUENCE, DEPLOYMENTS_PATH, NAMESPACE, Cluster, eventually
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


def writes_to(cluster: Cluster, deployment: str, start: int = 0) -> list[str]:
    path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{deployment}"
    return [r.method for r in cluster.writes(start) if r.url.path == path]


def play_controller(cluster: Cluster, deployment: str, *, stalled: bool = False) -> None:
    """The Deployment controller on one Deployment: its generation rolled out and available,
    or (``stalled``) its pods never available and its progress deadline passed."""
    obj = next(
        o
        for (resource, namespace, name), o in list(cluster.api.objects.items())
        if resource.plural == "deployments" and (namespace, name) == (NAMESPACE, deployment) and not o.deleted
    )
    replicas = obj.raw.get("spec", {}).get("replicas", 1)
    status: dict[str, Any] = {
        "observedGeneration": obj.raw["metadata"]["generation"],
        "replicas": replicas,
        "updatedReplicas": replicas,
        "availableReplicas": 0 if stalled else replicas,
    }
    if stalled:
        status["conditions"] = [
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": f'ReplicaSet "{deployment}-7d9" has timed out progressing.',
            }
        ]
    obj.patch({"status": status, "metadata": {"resourceVersion": str(next(_SEQUENCE))}})


async def test_consumers_wait_until_the_master_and_the_store_serve(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest())
    await eventually(lambda: cluster.get(DEPLOYMENTS_PATH, "pool-store"), what="the store is created")

    # Neither the master nor the store is available: the consumer is not touched.
    start = cluster.mark()
    await cluster.passes("pool", start, count=3)
    assert writes_to(cluster, "llm") == []
    rollout = cluster.condition("pool", "ConsumersRolledOut")
    assert rollout["status"] == "False"
    assert "does not serve yet" in cluster.pool_status("pool")["consumers"][0]["message"]

    # The master serves, the store not yet: still nothing.
    play_controller(cluster, "pool-master")
    await eventually(lambda: cluster.condition("pool", "MasterReady").get("status") == "True")
    await cluster.passes("pool", cluster.mark(), count=2)
    assert writes_to(cluster, "llm") == []

    # Both serve: the consumer gets its settings.
    play_controller(cluster, "pool-store")
    await eventually(lambda: kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm")), what="llm injected")
    await converge(cluster, generation=1)


async def test_one_consumer_at_a_time_stopping_at_one_that_never_becomes_available(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create(vllm_deployment("llm"))
    await cluster.create(vllm_deployment("chat"))
    await cluster.create(pool_manifest(spec=pool_spec(consumers=[consumer("llm"), consumer("chat")])))
    await eventually(lambda: cluster.get(DEPLOYMENTS_PATH, "pool-store"), what="the store is created")
    play_controller(cluster, "pool-master")
    play_controller(cluster, "pool-store")

    # llm first; chat waits while llm rolls.
    await eventually(lambda: kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm")), what="llm injected")
    await cluster.passes("pool", cluster.mark(), count=2)
    assert writes_to(cluster, "chat") == []
    chat = cluster.pool_status("pool")["consumers"][1]
    assert chat["rolledOut"] is False and "llm is rolling out first" in chat["message"]

    # llm never becomes available: the rollout stops there, says so once, and chat is left alone.
    play_controller(cluster, "llm", stalled=True)
    stalled = await eventually(
        lambda: (
            cluster.condition("pool", "ConsumersRolledOut").get("reason") == "RolloutStalled"
            and cluster.condition("pool", "ConsumersRolledOut")
        ),
        what="RolloutStalled",
    )
    assert stalled["status"] == "False"
    assert stalled["message"].startswith("llm did not become available")
    assert "ProgressDeadlineExceeded" in stalled["message"] or "timed out progressing" in stalled["message"]
    (event,) = await eventually(lambda: cluster.events("ConsumerRolloutStalled"), what="an Event")
    assert event["type"] == "Warning" and "llm" in event["message"]
    start = cluster.mark()
    await cluster.passes("pool", start, count=3)
    assert writes_to(cluster, "chat") == []
    assert len(cluster.events("ConsumerRolloutStalled")) == 1
    assert "stopped at llm" in cluster.pool_status("pool")["consumers"][1]["message"]

    # llm recovers (fixed by its owner): chat follows, and the pool is Ready.
    play_controller(cluster, "llm")
    await eventually(lambda: kv_flags(cluster.get(DEPLOYMENTS_PATH, "chat")), what="chat injected")
    status = await converge(cluster, generation=1)
    assert [c["rolledOut"] for c in status["consumers"]] == [True, True]
    chat_template = cluster.get(DEPLOYMENTS_PATH, "chat")["spec"]["template"]
    assert names.ANNOTATION_CONFIG_HASH in chat_template["metadata"]["annotations"]
