"""The operator under API faults that tests/operator/test_operator_faults.py does not cover.

* restarted mid-reconcile (a create still in flight on the server when it stops);
* slow responses, one slower than the client's timeout (the server still applies it);
* a consumer whose layout turns invalid, with an API fault and a restart on top.

Each time: it converges to the children and status a clean run gives, never creates a
child twice, never patches a consumer while the spec is invalid. kmock is the API server
(over HTTP on 127.0.0.1), the operator is the real one (kopf, handlers, client).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kmock
import pytest
import pytest_asyncio

from kvpool.operator import names
from kvpool.operator.app import OperatorOptions
from kvpool.operator.consumers import FLAG, injected
from kvpool.operator.names import POOLS
from kvpool.operator.plan import build_plan
from testing.kube_api import (
    DEPLOYMENTS_PATH,
    NAMESPACE,
    ApiServer,
    Cluster,
    Fault,
    OperatorThread,
    emulated_cluster,
    eventually,
    operator_request,
    quick_options,
    running_operator,
    write_kubeconfig,
)
from testing.operator_objects import (
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

pytestmark = [pytest.mark.faults, pytest.mark.asyncio, pytest.mark.timeout(180)]


@dataclass
class Slow:
    """Hold the operator's next ``times`` matching requests for ``seconds``, then serve them."""

    method: str
    plural: str
    seconds: float
    times: int = 1
    begun: asyncio.Event = field(default_factory=asyncio.Event)

    def matches(self, request: kmock.Request) -> bool:
        return self.times > 0 and operator_request(request, self.method, self.plural)


class SlowApiServer(ApiServer):
    """The emulated API server, plus answers that take their time."""

    def slow(self, slow: Slow) -> Slow:
        self.__dict__.setdefault("slows", []).append(slow)
        return slow

    async def _handle(self, request: kmock.Request) -> Any:
        for slow in self.__dict__.get("slows", []):
            if slow.matches(request):
                slow.times -= 1
                slow.begun.set()
                await asyncio.sleep(slow.seconds)
                break
        return await super()._handle(request)


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async with emulated_cluster(SlowApiServer) as cluster:
        yield cluster


_runs = itertools.count()


def operator_against(
    cluster: Cluster, tmp_path: Path, **overrides: Any
) -> AbstractAsyncContextManager[OperatorThread]:
    """The real operator against ``cluster`` until the block ends (then stopped, errors raised)."""
    kubeconfig = write_kubeconfig(tmp_path / f"kubeconfig-{next(_runs)}", cluster.url)
    return running_operator(cluster, OperatorOptions(**quick_options(kubeconfig, **overrides)))


def assert_same_state_as_a_clean_run(cluster: Cluster, status: dict[str, Any], spec: dict[str, Any]) -> None:
    """Children exactly as planned, each once and owned once; the consumer injected once; status Ready."""
    plan = build_plan("pool", NAMESPACE, spec)
    planned = {(child["kind"], child["metadata"]["name"]) for child in plan.children}
    for child in plan.children:
        live = cluster.get(path_of(child), child["metadata"]["name"])
        assert live is not None and kmock.Object(live) >= stored(child)
        assert len(live["metadata"]["ownerReferences"]) == 1
    # Nothing else carries the pool's label: no stray or duplicated child.
    labelled = {
        (obj.raw.get("kind"), name)
        for (resource, _, name), obj in list(cluster.api.objects.items())
        if not obj.deleted
        and (obj.raw.get("metadata", {}).get("labels") or {}).get(names.LABEL_POOL) == "pool"
    }
    assert labelled == planned
    posts = Counter(
        (r.resource.plural, r.data.get("metadata", {}).get("name"))
        for r in cluster.requests()
        if r.method.upper() == "POST"
        and r.resource is not None
        and isinstance(r.data, dict)
        and r.resource.plural not in ("events",)
    )
    assert all(count <= 2 for count in posts.values()), posts  # a retry after a lost answer at most
    consumer = cluster.get(DEPLOYMENTS_PATH, "llm")
    assert template(consumer) == template(stored(injected(as_created(cluster, "llm"), plan.consumers[0])))
    assert kv_flags(consumer) == [f"{FLAG}={plan.consumers[0].kv_transfer_config}"]
    assert status["phase"] == "Ready"
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        **dict.fromkeys(("ConfigValid", "MasterReady", "StoreReady", "ConsumersRolledOut"), "True"),
        "Conflict": "False",
        **dict.fromkeys(("Observed", "Degraded"), "Unknown"),  # the master is not asked here
    }
    assert status["consumers"][0]["configHash"] == plan.consumers[0].config_hash


async def test_restarted_mid_reconcile_converges_without_duplicates(cluster: Cluster, tmp_path: Path) -> None:
    api: SlowApiServer = cluster.api  # type: ignore[assignment]
    # The first Deployment the operator creates stays on the server for 6 s, then is created
    # anyway: the operator that sent it is gone by then and never sees the answer.
    held = api.slow(Slow("POST", "deployments", seconds=6.0))
    await cluster.create(vllm_deployment())
    async with operator_against(cluster, tmp_path, request_timeout=30.0):
        await cluster.create(pool_manifest())
        await asyncio.wait_for(held.begun.wait(), 30)
    # The first operator stopped mid-reconcile: some children exist, others not, no status yet.
    assert cluster.pool_status("pool").get("phase") != "Ready"
    await asyncio.sleep(6.5)  # the held create lands
    async with operator_against(cluster, tmp_path):
        status = await converge(cluster, generation=1)
        assert_same_state_as_a_clean_run(cluster, status, pool_spec())
        await cluster.quiet("pool")


async def test_slow_answers_and_a_timeout_converge_without_duplicates(
    cluster: Cluster, tmp_path: Path
) -> None:
    api: SlowApiServer = cluster.api  # type: ignore[assignment]
    api.slow(Slow("GET", "deployments", seconds=0.3, times=20))
    api.slow(Slow("PATCH", "deployments", seconds=0.5, times=3))
    # Slower than the client's 2 s timeout: the operator gives up, the server creates it anyway.
    late = api.slow(Slow("POST", "configmaps", seconds=3.0))
    await cluster.create(vllm_deployment())
    async with operator_against(cluster, tmp_path, request_timeout=2.0) as thread:
        await cluster.create(pool_manifest())
        await asyncio.wait_for(late.begun.wait(), 30)
        status = await converge(cluster, generation=1)
        assert_same_state_as_a_clean_run(cluster, status, pool_spec())
        await cluster.quiet("pool")
        assert thread.alive


async def test_a_consumer_is_never_patched_while_its_layout_is_invalid(
    cluster: Cluster, tmp_path: Path
) -> None:
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest())
    async with operator_against(cluster, tmp_path):
        await converge(cluster, generation=1)
    before = cluster.get(DEPLOYMENTS_PATH, "llm")
    children = {
        c["metadata"]["name"]: cluster.get(path_of(c), c["metadata"]["name"])
        for c in build_plan("pool", NAMESPACE, pool_spec()).children
    }
    start = cluster.mark()

    # The consumer's layout turns invalid (cross attention) together with a connector change
    # that would otherwise roll it; the status write fails once; the operator restarts.
    bad = pool_spec(connector={"cache_prefix": "team-b"})
    bad["consumers"][0]["layout"]["groups"].append({"kind": "cross", "block_size": 16})
    cluster.api.fail(Fault("PATCH", POOLS.plural, 500, subresource="status"))
    async with operator_against(cluster, tmp_path):
        await cluster.patch_pool("pool", {"spec": bad})
        await eventually(lambda: cluster.pool_status("pool").get("phase") == "Invalid", what="Invalid")
    async with operator_against(cluster, tmp_path):
        await eventually(lambda: cluster.handled("pool"), what="kopf is done with the pool")
        await cluster.passes("pool", cluster.mark(), count=2)
        condition = cluster.condition("pool", "ConfigValid")
        assert (
            condition["status"] == "False"
            and "spec.consumers[0].layout.groups[2].kind" in condition["message"]
        )

        deployment_writes = [
            r for r in cluster.writes(start) if r.resource is not None and r.resource.plural == "deployments"
        ]
        assert deployment_writes == [], [f"{r.method} {r.url.path}" for r in deployment_writes]
        assert cluster.get(DEPLOYMENTS_PATH, "llm") == before
        for name, live in children.items():
            assert live is not None
            assert cluster.get(path_of(live), name) == live, f"{name} changed while the spec was invalid"

        # Valid again: the change it held back rolls out now.
        fixed = pool_spec(connector={"cache_prefix": "team-b"})
        await cluster.patch_pool("pool", {"spec": fixed})
        status = await converge(cluster, generation=3)
        assert_same_state_as_a_clean_run(cluster, status, fixed)
