"""An operator restart changes nothing a consumer or an SRE sees (``first_poll``).

The master's last answer lives in the operator's memory only: a new process (restarted, or a
standby that took the Lease over) has none until its first poll. Pure: when a pass keeps the
conditions the poll decides, and that kept ones keep their transition time and the phase.
On the emulated API: across a restart whose first poll is held back (a stand-in master on
loopback that answers only when the test lets it), every status write the API received keeps
an external pool serving and a degraded operator-run pool degraded, and a pod-admission
consumer created meanwhile is admitted.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import pytest
from aiohttp import web

from kvpool.connector.local.ports import free_port
from kvpool.operator.app import INJECT_ID, OperatorOptions, WebhookOptions
from kvpool.operator.capacity import apply_observation
from kvpool.operator.first_poll import (
    EXTERNAL_CONDITIONS,
    POLL_CONDITIONS,
    first_poll_bound,
    holds_for_first_poll,
    kept_conditions,
)
from kvpool.operator.kube import KubeClient
from kvpool.operator.master_view import TENANT_CHARGED, TENANT_EFFECTIVE, TENANT_REQUESTED
from kvpool.operator.metrics import OperatorMetrics
from kvpool.operator.names import GRANTS, POOLS, ApiResource
from kvpool.operator.observation import Observation
from kvpool.operator.plan import build_plan
from kvpool.operator.pod_injection import POD_ADMISSION
from kvpool.operator.reconcile import Reconciler
from testing.kube_api import (
    GRANTS_PATH,
    NAMESPACE,
    Cluster,
    eventually,
    held_port,
    post_admission_review,
    quick_options,
    running_operator,
    write_kubeconfig,
)
from testing.operator_objects import pool_manifest, pool_spec
from testing.pod_admission import pod_review, replica_set_pod
from tests.operator.test_grants_on_the_api import grant_manifest, tenancy_spec
from tests.operator.test_pod_admission import opted_in
from tests.operator.test_store_drain import POLICY, stand_in_master_text, store_pod

T0 = "2026-12-03T10:00:00Z"
T1 = "2026-12-03T10:05:00Z"


def stored(kind: str, status: str, reason: str, at: str = T0) -> dict[str, Any]:
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": f"{kind} as the last operator wrote it",
        "lastTransitionTime": at,
        "observedGeneration": 3,
    }


def serving_status() -> dict[str, Any]:
    """A degraded pool's status as the operator before the restart left it (generation 3)."""
    return {
        "observedGeneration": 3,
        "phase": "Degraded",
        "conditions": [
            stored("ConfigValid", "True", "Valid"),
            stored("MasterReady", "True", "ExternalServes"),
            stored("StoreReady", "True", "ExternalMemory"),
            stored("ConsumersRolledOut", "True", "RolledOut"),
            stored("Conflict", "False", "NoConflicts"),
            stored("Observed", "True", "Answered"),
            stored("Degraded", "True", "StoreDown"),
        ],
    }


# --- Pure: the decision ---------------------------------------------------------------------


def holds(**changed: Any) -> bool:
    decision: dict[str, Any] = {
        "asked": True,
        "polled": False,
        "waited": 0.5,
        "bound": 19.0,
        "status": serving_status(),
        "generation": 3,
    }
    return holds_for_first_poll(**{**decision, **changed})


def test_a_pass_before_the_first_poll_keeps_what_the_status_holds() -> None:
    assert holds()


def test_the_hold_ends_with_the_first_poll_at_its_bound_or_for_another_spec() -> None:
    assert not holds(polled=True)  # answered or not: the poll says what it found
    assert not holds(waited=19.0)  # no poll within the bound: that is what the status says
    assert not holds(generation=4)  # a spec changed meanwhile may name another master
    assert not holds(status={}, generation=1)  # a pool never observed: nothing to keep
    assert not holds(asked=False)  # a master not asked: its conditions never wait for a poll


def test_the_bound_is_two_ticks_of_the_observation_timer_each_with_a_whole_poll() -> None:
    assert first_poll_bound(observe_interval=15.0, observe_timeout=3.0) == 1.0 + 15.0 + 3.0
    assert first_poll_bound(observe_interval=0.5, observe_timeout=3.0) == 0.5 + 0.5 + 3.0


@pytest.mark.asyncio
async def test_a_reconciler_holds_until_its_first_poll_and_never_past_its_bound() -> None:
    reconciler = Reconciler(
        cast(KubeClient, None), OperatorMetrics(), POLICY, observe_timeout=3.0, observe_interval=15.0
    )
    assert reconciler.first_poll_bound == 19.0
    plan = build_plan("pool", NAMESPACE, pool_spec(), POLICY)
    assert plan.valid and plan.observed
    status = serving_status()
    assert reconciler.first_poll_pending(plan, status, 3)
    reconciler.first_poll_bound = 0.0  # as if its bound had passed since the first pass
    assert not reconciler.first_poll_pending(plan, status, 3)
    reconciler.first_poll_bound = 19.0
    reconciler.observations[(plan.namespace, plan.pool)] = Observation(T1, problem="no answer")
    assert not reconciler.first_poll_pending(plan, status, 3)  # polled: unanswered is an answer


def test_only_conditions_the_status_holds_are_kept() -> None:
    kept = kept_conditions(serving_status(), EXTERNAL_CONDITIONS)
    assert kept is not None
    assert [(c.type, c.status, c.reason, c.last_transition_time) for c in kept] == [
        ("MasterReady", "True", "ExternalServes", T0),
        ("StoreReady", "True", "ExternalMemory", T0),
    ]
    fresh = {"conditions": [stored("MasterReady", "True", "ExternalServes")]}
    assert kept_conditions(fresh, EXTERNAL_CONDITIONS) is None  # StoreReady missing: none kept
    assert kept_conditions({}, POLL_CONDITIONS) is None


def test_kept_poll_conditions_keep_their_time_and_the_degraded_phase() -> None:
    old = serving_status()
    without = {**old, "conditions": [c for c in old["conditions"] if c["type"] not in POLL_CONDITIONS]}
    held = kept_conditions(old, POLL_CONDITIONS)
    kept = apply_observation(without, old, None, asked=True, external=False, expected=2, now=T1, held=held)
    assert kept["phase"] == "Degraded"
    assert kept["conditions"] == old["conditions"]
    # The negative control: decided from "no poll yet", the pool reads Ready and not observed.
    unkept = apply_observation(without, old, None, asked=True, external=False, expected=2, now=T1)
    by_type = {c["type"]: c for c in unkept["conditions"]}
    assert unkept["phase"] == "Ready"
    assert (by_type["Observed"]["reason"], by_type["Observed"]["lastTransitionTime"]) == ("NotYet", T1)


# --- On the emulated API: across a restart --------------------------------------------------


class StandInMaster:
    """``/health`` and ``/metrics`` of a master on 127.0.0.1, answering only while ``open``."""

    def __init__(self, *store_ips: str, tenant: str | None = None) -> None:
        self.open = asyncio.Event()
        self.asked = 0
        self.text = stand_in_master_text(*store_ips)
        if tenant is not None:
            labels = f'{{tenant_id="{tenant}"}}'
            self.text += "".join(
                f"{name}{labels} {value}\n"
                for name, value in (
                    (TENANT_REQUESTED, 16 << 20),
                    (TENANT_EFFECTIVE, 16 << 20),
                    (TENANT_CHARGED, 1 << 20),
                )
            )
        self.port = free_port()

    async def health(self, _: web.Request) -> web.Response:
        self.asked += 1
        await self.open.wait()
        return web.json_response({"role": "leader", "service_ready": True})

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=self.text)

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[StandInMaster]:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        try:
            yield self
        finally:
            self.open.set()  # a held request ends before the server does
            await runner.cleanup()


def status_writes(
    cluster: Cluster, start: int, resource: ApiResource = POOLS, name: str = "pool"
) -> list[dict]:
    """Every status the operator wrote to ``name`` since mark ``start``: each merge patch's
    ``status`` (a merge patch carries the whole conditions list when one changed)."""
    path = resource.path(NAMESPACE, name, "status")
    return [dict(w.data)["status"] for w in cluster.writes(start) if w.url.path == path]


def flaps(writes: list[dict[str, Any]], wanted: dict[str, str]) -> list[str]:
    """Each written condition of ``wanted`` (type: status) that says otherwise."""
    return [
        f"{c['type']}={c['status']} ({c.get('reason')}: {c.get('message')})"
        for status in writes
        for c in status.get("conditions") or []
        if c.get("type") in wanted and c.get("status") != wanted[c["type"]]
    ]


def conditions(cluster: Cluster) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in cluster.pool_status("pool").get("conditions") or []}


@asynccontextmanager
async def restarted(
    cluster: Cluster,
    master: StandInMaster,
    options: Callable[[], OperatorOptions],
    before: Callable[[], bool],
) -> AsyncIterator[int]:
    """Run the operator until ``before`` holds, stop it, hold the master's answers back, and
    run a new one: in it, once it made three passes and asked the master (no answer yet),
    the block runs with the mark of the restart."""
    master.open.set()
    async with running_operator(cluster, options()):
        await eventually(
            lambda: cluster.settle() or before(), what="the pool as the first operator leaves it"
        )
    master.open.clear()
    start = cluster.mark()
    asked = master.asked
    async with running_operator(cluster, options()):
        await cluster.passes("pool", start, count=3)
        await eventually(lambda: master.asked > asked, what="the new operator's first poll, held")
        yield start


@pytest.mark.asyncio
async def test_a_restart_keeps_an_external_pool_serving_and_admits_its_new_consumer(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An external pool whose master the operator polls (``metricsEndpoints``): its
    ``MasterReady``/``StoreReady`` are that master's answer. The new operator's first passes
    come before its first poll; they keep what the status says (transition times too), and
    the webhook admits a Pod of a consumer Deployment created just then."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", cluster.url)
    webhook_ports: list[int] = []

    def options() -> OperatorOptions:
        webhook_ports.append(held_port())
        hook = WebhookOptions(port=webhook_ports[-1], addr="127.0.0.1", host="127.0.0.1", insecure=True)
        return OperatorOptions(
            **quick_options(kubeconfig, webhook=hook, injection_mode=POD_ADMISSION, observe_timeout=30.0)
        )

    async with StandInMaster("10.0.0.1").serving() as master:
        spec = pool_spec(
            external={
                "masterServerAddress": "mooncake-master.platform.svc:50051",
                "metricsEndpoints": [f"localhost:{master.port}"],
            }
        )
        del spec["image"], spec["store"]
        await cluster.create(pool_manifest(spec=spec))

        def serves() -> bool:
            found = conditions(cluster)
            return all(
                found.get(k, {}).get("status") == "True" for k in ("MasterReady", "StoreReady", "Observed")
            )

        async with restarted(cluster, master, options, serves) as start:
            before = conditions(cluster)
            await cluster.create(opted_in())  # a consumer not yet running the pool's settings
            url = f"http://127.0.0.1:{webhook_ports[-1]}/{INJECT_ID}"
            answer = await post_admission_review(url, pod_review(replica_set_pod(opted_in())))
            assert answer["response"]["allowed"] is True, answer["response"].get("status")
            master.open.set()
            await cluster.passes("pool", cluster.mark(), count=2)
    wanted = {"MasterReady": "True", "StoreReady": "True", "Observed": "True"}
    assert flaps(status_writes(cluster, start), wanted) == []
    after = conditions(cluster)
    for kind in wanted:
        assert after[kind]["lastTransitionTime"] == before[kind]["lastTransitionTime"], kind
    assert after["MasterReady"]["reason"] == "ExternalServes"


@pytest.mark.asyncio
async def test_a_restart_keeps_a_degraded_pool_degraded_until_its_master_says_otherwise(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator-run pool with one of its two store pods not mounted: ``Degraded``. Its
    ``MasterReady``/``StoreReady`` come from its Deployments, but ``Observed`` and
    ``Degraded`` from the poll: the new operator's first passes keep them, so the phase stays
    ``Degraded`` and no ``PoolRecovered`` Event claims a recovery that never happened. Its
    grant's usage (tenancy on) is the poll's too: kept as well."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", cluster.url)
    tenant = f"{NAMESPACE}.team-a"
    async with StandInMaster("10.0.0.1", tenant=tenant).serving() as master:

        def options() -> OperatorOptions:
            health = f"http://127.0.0.1:{master.port}/health"
            return OperatorOptions(
                **quick_options(kubeconfig, policy=POLICY, master_health_url=health, observe_timeout=30.0)
            )

        for i in range(2):
            await cluster.create(store_pod(f"pool-store-{i}", f"10.0.0.{i + 1}", "Running", ready=True))
        await cluster.create(grant_manifest("team-a", "16MB"))
        await cluster.create(pool_manifest(spec=tenancy_spec("team-a")))

        def usage() -> dict[str, Any]:
            return ((cluster.get(GRANTS_PATH, "team-a") or {}).get("status") or {}).get("usage") or {}

        def degraded() -> bool:
            return (
                cluster.pool_status("pool").get("phase") == "Degraded" and usage().get("state") == "Observed"
            )

        async with restarted(cluster, master, options, degraded) as start:
            master.open.set()
            await cluster.passes("pool", cluster.mark(), count=2)
    writes = status_writes(cluster, start)
    assert flaps(writes, {"Observed": "True", "Degraded": "True"}) == []
    assert [w["phase"] for w in writes if "phase" in w and w["phase"] != "Degraded"] == []
    assert cluster.events("PoolRecovered") == []
    assert json.dumps(conditions(cluster)["Degraded"]).count("StoreDown") == 1
    usages = [w["usage"] for w in status_writes(cluster, start, GRANTS, "team-a") if "usage" in w]
    assert [u for u in usages if u.get("state") not in (None, "Observed")] == []
    assert usage()["state"] == "Observed"
