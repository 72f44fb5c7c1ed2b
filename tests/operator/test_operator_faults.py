"""API failures (500s, 409s, a dropped watch): the operator converges to the same state."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import kmock
import pytest

from kvpool.operator.consumers import FLAG, injected
from kvpool.operator.metric_names import RECONCILE_ERRORS
from kvpool.operator.names import POOLS
from kvpool.operator.plan import build_plan
from testing.kube_api import (
    DEPLOYMENTS_PATH,
    NAMESPACE,
    POOLS_PATH,
    Cluster,
    Fault,
    eventually,
)
from testing.operator_objects import (
    Operator,
    as_created,
    converge,
    kv_flags,
    path_of,
    pool_manifest,
    pool_spec,
    stored,
    template,
    vllm_deployment,
)

pytestmark = pytest.mark.asyncio


@pytest.fixture
def dropped_watch(cluster: Cluster) -> Iterator[None]:
    """The operator's first watch of pools goes silent and ends: events in it are lost."""
    cluster.api[kmock.action.WATCH, kmock.resource(POOLS_PATH)][:1] << (b"", lambda: asyncio.sleep(1.0))
    yield


async def scrape(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200
        return await response.text()


async def test_faults_converge_to_the_same_state(
    cluster: Cluster, dropped_watch: None, operator: Operator
) -> None:
    faults = [
        cluster.api.fail(Fault("POST", "configmaps", 500)),
        cluster.api.fail(Fault("POST", "deployments", 503)),
        cluster.api.fail(Fault("PATCH", "deployments", 409, name="llm")),
        cluster.api.fail(Fault("PATCH", POOLS.plural, 500, subresource="status")),
    ]
    await cluster.create(vllm_deployment())
    # Created while the operator's watch is silent: only a fresh watch can see it.
    await cluster.create(pool_manifest())
    status = await converge(cluster, generation=1)
    assert [f.times for f in faults] == [0, 0, 0, 0]
    watches = [
        r
        for r in cluster.requests()
        if r.action == kmock.action.WATCH and r.resource is not None and r.resource.plural == POOLS.plural
    ]
    assert len(watches) >= 2

    # The same state as a clean run: what the pure plan says, nothing twice.
    plan = build_plan("pool", NAMESPACE, pool_spec())
    for child in plan.children:
        live = cluster.get(path_of(child), child["metadata"]["name"])
        assert live is not None and kmock.Object(live) >= stored(child)
        assert len(live["metadata"]["ownerReferences"]) == 1
    consumer = cluster.get(DEPLOYMENTS_PATH, "llm")
    assert template(consumer) == template(stored(injected(as_created(cluster, "llm"), plan.consumers[0])))
    assert kv_flags(consumer) == [f"{FLAG}={plan.consumers[0].kv_transfer_config}"]
    assert status["consumers"][0]["configHash"] == plan.consumers[0].config_hash

    text = await scrape(operator.metrics_url)
    assert f'{RECONCILE_ERRORS.exported}{{reason="http_500"' in text
    assert f'{RECONCILE_ERRORS.exported}{{reason="http_409"' in text

    await cluster.quiet("pool")  # kopf finishes its retried handlers, then nothing


async def test_a_consumer_patched_by_someone_else_is_put_right(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest())
    await converge(cluster, generation=1)
    injection = build_plan("pool", NAMESPACE, pool_spec()).consumers[0]
    # Someone re-applies the original manifest's args (our flag gone, theirs back).
    original_args = as_created(cluster, "llm")["spec"]["template"]["spec"]["containers"][0]["args"]
    live = cluster.get(DEPLOYMENTS_PATH, "llm")
    assert live is not None
    containers = template(live)["spec"]["containers"]
    containers[0]["args"] = original_args
    response = await cluster.api.patch(
        f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/llm",
        json={"spec": {"template": {"spec": {"containers": containers}}}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert response.status == 200
    await eventually(
        lambda: kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm")) == [f"{FLAG}={injection.kv_transfer_config}"],
        what="re-injected",
    )
