"""Scaling stores down: drain first, then remove only the drained pods (``store_drain``).

Pure: the replicas each pass applies through a drain's states, where no drain is tried, a
drain called off, drained pods that stay ready. Real processes (a master and two stores on
their own 127.x addresses): Mooncake's drain job moves a segment's objects to the other store
byte for byte and places no new write on it; the store readiness probe the operator renders
fails on exactly the drained store; stopping it then loses nothing, where stopping a store
that was not drained loses what it held (the negative control). The whole flow through the
operator is in ``test_real_mooncake.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from kubernetes_asyncio.client import ApiClient

from kvpool.connector.local.pool import MooncakeMaster, MooncakeStore, wait_for_capacity
from kvpool.connector.local.ports import free_port
from kvpool.connector.pool_client import PoolClient
from kvpool.operator.app import OperatorOptions
from kvpool.operator.drain_jobs import DrainRefused, cancel_drain_job, create_drain_job, query_drain_job
from kvpool.operator.drain_timer import advance, drain_base
from kvpool.operator.kube import KubeClient, load_configuration
from kvpool.operator.master_view import MasterNumbers, Segment
from kvpool.operator.metrics import OperatorMetrics
from kvpool.operator.names import STORE
from kvpool.operator.observation import Observation, poll_master
from kvpool.operator.plan import Plan, build_plan
from kvpool.operator.policy import OperatorPolicy
from kvpool.operator.reconcile import Reconciler, store_scale_of
from kvpool.operator.spec import StoreDrainStatus
from kvpool.operator.store_drain import (
    DRAINED,
    DRAINING,
    GIVEN_UP,
    PENDING,
    WITHDRAWN,
    drained_message,
    dump,
    leaving_segments,
    new_record,
    store_scale,
)
from kvpool.operator.store_probe import MASTER_HTTP_ENV, MEMORY_ENV, SCRIPT, STORE_PORT_ENV
from testing.kube_api import (
    DEPLOYMENTS_PATH,
    NAMESPACE,
    UNSERVED_MASTER_HEALTH_URL,
    Cluster,
    eventually,
    quick_options,
    running_operator,
    write_kubeconfig,
)
from testing.master_health import health_server
from testing.operator_objects import pool_manifest, pool_pod, pool_spec
from testing.pool_store import bare_client, put_on, raw_store

T0 = "2026-12-03T10:00:00Z"
T1 = "2026-12-03T10:01:00Z"
LATE = "2026-12-03T11:00:00Z"


# The operator's pods are known: the pool's NetworkPolicy lets it reach the master.
POLICY = OperatorPolicy(operator_namespace="kvpool-system", operator_pod_labels=(("app", "op"),))


def plan_of(replicas: int, **store: Any) -> Plan:
    spec = pool_spec(store={"segmentSize": "1GB", "replicas": replicas, **store})
    plan = build_plan("pool", NAMESPACE, spec, POLICY)
    assert plan.valid, plan.problems
    return plan


def observation(*allocated: int) -> Observation:
    """A poll that named one segment per store pod ``pool-store-<i>`` at 10.0.0.<i>."""
    segments = tuple(Segment(f"10.0.0.{i}:15000", 1 << 30, used) for i, used in enumerate(allocated))
    numbers = MasterNumbers(
        capacity_bytes=len(allocated) << 30, allocated_bytes=sum(allocated), objects=3, segments=segments
    )
    pods = {f"10.0.0.{i}": f"pool-store-{i}" for i in range(len(allocated))}
    return Observation(at=T0, master="m", numbers=numbers, store_pods=pods)


# --- Pure: what each pass applies ----------------------------------------------------------


def test_a_scale_down_holds_until_the_drained_pods_are_not_ready() -> None:
    plan = plan_of(1)
    begun = store_scale(plan, 3, None, observation(5, 1, 9), ["pool-store-0", "pool-store-1"], T0)
    assert begun.replicas == 3 and begun.begins  # held at the live count
    pending = begun.drain
    assert pending is not None and pending.state == PENDING
    assert (pending.from_replicas, pending.to_replicas) == (3, 1)
    assert pending.deadline == "2026-12-03T10:05:00Z"  # drainTimeoutSeconds, 300 by default

    draining = pending.model_copy(
        update={"state": DRAINING, "job_id": "j", "pods": ["pool-store-1", "pool-store-0"]}
    )
    held = store_scale(plan, 3, draining, None, [], T1)
    assert (held.replicas, held.drain, held.begins) == (3, draining, False)

    drained = draining.model_copy(update={"state": DRAINED, "moved_objects": 2, "moved_bytes": 6 << 20})
    one_still_ready = store_scale(plan, 3, drained, None, ["pool-store-0", "pool-store-2"], T1)
    assert (one_still_ready.replicas, one_still_ready.drain) == (3, drained)

    done = store_scale(plan, 3, drained, None, ["pool-store-2"], T1)
    assert (done.replicas, done.drain, done.ended, done.stayed_ready) == (1, None, drained, ())
    message = drained_message(drained)
    assert "pool-store-1, pool-store-0" in message and "2 objects, 6Mi moved" in message
    assert "not ready" in message


def test_drained_pods_still_ready_at_the_deadline_go_with_a_warning() -> None:
    drained = new_record(
        state=DRAINED, from_replicas=2, to_replicas=1, started_at=T0, deadline=T1, pods=["pool-store-1"]
    )
    late = store_scale(plan_of(1), 2, drained, None, ["pool-store-0", "pool-store-1"], LATE)
    assert (late.replicas, late.drain, late.stayed_ready) == (1, None, ("pool-store-1",))
    assert "may remove other pods instead" in drained_message(drained, late.stayed_ready)


def test_a_scale_down_holds_while_a_staying_store_is_not_ready() -> None:
    """Only the drained pods may be unready when the lower count is applied: the controller
    removes unready pods first, and a staying store that missed its probes (with what it
    holds) would go in place of a drained one."""
    drained = new_record(
        state=DRAINED, from_replicas=3, to_replicas=2, started_at=T0, deadline=T1, pods=["pool-store-2"]
    )
    plan = plan_of(2)
    slow = store_scale(plan, 3, drained, None, ["pool-store-0"], T0, ["pool-store-1", "pool-store-2"])
    assert (slow.replicas, slow.drain) == (3, drained)
    done = store_scale(plan, 3, drained, None, ["pool-store-0", "pool-store-1"], T0, ["pool-store-2"])
    assert (done.replicas, done.drain, done.warns) == (2, None, False)
    late = store_scale(plan, 3, drained, None, ["pool-store-0"], LATE, ["pool-store-1", "pool-store-2"])
    assert (late.replicas, late.unready_kept, late.warns) == (2, ("pool-store-1",), True)
    message = drained_message(drained, late.stayed_ready, late.unready_kept)
    assert "at the deadline pool-store-1 (staying) not ready" in message
    assert "may remove other pods instead" in message


def test_a_drain_given_up_scales_down_as_without_one() -> None:
    given_up = new_record(state=GIVEN_UP, from_replicas=2, to_replicas=1, started_at=T0, deadline=T1)
    scale = store_scale(plan_of(1), 2, given_up, None, ["pool-store-0"], T1)
    assert (scale.replicas, scale.drain, scale.ended) == (1, None, given_up)


@pytest.mark.parametrize(
    ("why", "plan", "seen"),
    [
        ("drains off", plan_of(1, drainTimeoutSeconds=0), observation(1, 2)),
        ("to zero: nowhere to move to", dataclasses.replace(plan_of(1), store_replicas=0), observation(1, 2)),
        (
            "the operator may not ask the master, and never did",
            build_plan("pool", NAMESPACE, pool_spec()),
            None,
        ),
        ("the operator cannot reach it", build_plan("pool", NAMESPACE, pool_spec()), observation(1, 2)),
        ("the master did not answer", plan_of(1), Observation(at=T0, reason="Unreachable", problem="x")),
    ],
)
def test_where_no_drain_can_run_the_scale_down_is_at_once(
    why: str, plan: Plan, seen: Observation | None
) -> None:
    scale = store_scale(plan, 2, None, seen, [], T0)
    assert (scale.replicas, scale.drain) == (plan.store_replicas, None), why


def test_a_scale_down_waits_for_the_first_poll_of_a_master_it_may_ask() -> None:
    """A new operator process has not asked the master yet: no answer is no master that
    cannot answer. The live count is held, and the first answer starts the drain."""
    held = store_scale(plan_of(1), 2, None, None, [], T0)
    assert (held.replicas, held.drain) == (2, None)
    scale = store_scale(plan_of(1), 2, None, observation(1, 2), [], T0)
    assert scale.replicas == 2 and scale.drain is not None and scale.drain.state == PENDING


def test_ha_pools_drain_too_and_embedded_pools_have_no_store_to_drain() -> None:
    ha = build_plan(
        "pool",
        NAMESPACE,
        pool_spec(master={"replicas": 2, "ha": {"enabled": True, "etcdEndpoints": ["etcd:2379"]}}),
        POLICY,
    )
    embedded = build_plan("pool", NAMESPACE, pool_spec(store={"mode": "embedded"}), POLICY)
    assert ha.valid and embedded.valid and ha.drain_seconds == 300 and embedded.drain_seconds == 0
    (store,) = [c for c in ha.children if c["kind"] == "Deployment" and c["metadata"]["name"] == "pool-store"]
    (container,) = store["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["exec"]["command"] == ["python3", "-c", SCRIPT]


def test_with_ha_masters_drain_jobs_go_to_the_leader_the_poll_found() -> None:
    service = "http://pool-master.team-a.svc:9003"
    seen = dataclasses.replace(observation(1, 2), master="10.0.0.9:9003")
    assert drain_base(True, seen, service) == "http://10.0.0.9:9003"
    assert drain_base(False, seen, service) == service  # one master: its Service
    unanswered = Observation(at=T0, reason="Unreachable", problem="x")
    assert drain_base(True, unanswered, service) == service


def test_the_store_probe_and_its_env_are_rendered_when_drains_are_on() -> None:
    def store_container(plan: Plan) -> dict[str, Any]:
        (store,) = [
            c for c in plan.children if c["kind"] == "Deployment" and c["metadata"]["name"] == "pool-store"
        ]
        (container,) = store["spec"]["template"]["spec"]["containers"]
        return container

    on, off = store_container(plan_of(2)), store_container(plan_of(2, drainTimeoutSeconds=0))
    assert on["readinessProbe"]["exec"]["command"] == ["python3", "-c", SCRIPT]
    env = {e["name"]: e.get("value") for e in on["env"]}
    assert env[MASTER_HTTP_ENV] == f"http://pool-master.{NAMESPACE}.svc:9003"
    assert env[STORE_PORT_ENV] == "50052"
    # The probe keeps the master's last word in the pod's own writable /tmp (an emptyDir).
    assert env[MEMORY_ENV].startswith("/tmp/")
    assert {"name": "tmp", "mountPath": "/tmp"} in on["volumeMounts"]
    assert on["securityContext"]["readOnlyRootFilesystem"] is True
    assert off["readinessProbe"]["tcpSocket"] == {"port": "store"}
    assert MASTER_HTTP_ENV not in {e["name"] for e in off["env"]}
    # The template does not change with the count: scaling restarts no store.
    assert store_container(plan_of(5)) == on


def test_raising_replicas_back_calls_the_drain_off() -> None:
    pending = new_record(state=PENDING, from_replicas=3, to_replicas=1, started_at=T0, deadline=T1)
    assert store_scale(plan_of(3), 3, pending, None, [], T0).drain is None  # no job yet: gone
    draining = pending.model_copy(update={"state": DRAINING, "job_id": "j"})
    called_off = store_scale(plan_of(4), 3, draining, None, [], T0)
    assert called_off.replicas == 4 and called_off.drain is not None
    assert called_off.drain.state == WITHDRAWN  # the timer cancels its job, then clears it
    assert store_scale(plan_of(4), 3, called_off.drain, None, [], T0).replicas == 4
    # Lowered again before the timer gave the job back: held, the next drain comes after it.
    lowered = store_scale(plan_of(1), 3, called_off.drain, observation(1, 2, 3), [], T0)
    assert (lowered.replicas, lowered.drain) == (3, called_off.drain)


def test_the_leaving_segments_are_the_emptiest_named_ones() -> None:
    assert leaving_segments(observation(5, 1, 9), 2) == [
        ("10.0.0.1:15000", "pool-store-1"),
        ("10.0.0.0:15000", "pool-store-0"),
    ]
    assert leaving_segments(observation(5, 1), 2) is None  # none would be left to move to
    assert leaving_segments(None, 1) is None


# --- Real processes: Mooncake's drain job and the rendered probe -----------------------------

HOSTS = ("127.0.0.4", "127.0.0.5")
OBJECT = 1 << 20


@pytest.fixture
def two_stores() -> Iterator[tuple[MooncakeMaster, list[MooncakeStore]]]:
    """A master and store A (127.0.0.4); store B (127.0.0.5) is started by the test."""
    master = MooncakeMaster().start()
    stores = [MooncakeStore(master.address, "64MB", host=host) for host in HOSTS]
    try:
        stores[0].start(master)
        yield master, stores
    finally:
        for part in (*stores, master):
            part.stop()
            shutil.rmtree(part.log_dir, ignore_errors=True)


def segments_of(master: MooncakeMaster) -> dict[str, str]:
    """Each mounted segment by its host (the store's address)."""
    text = master.metrics()
    return {
        name.rsplit(":", 1)[0]: name
        for name in re.findall(r'segment_total_capacity_bytes\{segment="([^"]+)"', text)
    }


def put(client: PoolClient, keys: range, segment: str | None = None) -> None:
    for i in keys:
        assert put_on(client, f"drain-{i}", value(i), segment) == 0


def value(i: int) -> bytes:
    return bytes([i % 251]) * (OBJECT - i)


def missing(client: PoolClient, keys: range) -> list[int]:
    """The keys whose object does not read back byte for byte."""
    return [i for i in keys if raw_store(client).get(f"drain-{i}") != value(i)]


def probe(
    master: MooncakeMaster, store: MooncakeStore, through: str = "127.0.0.1", memory: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """The rendered readiness probe, run as the kubelet would in ``store``'s container, asking
    the master's HTTP port at ``through`` (the Service's address); ``memory``: the file in
    the pod's ``/tmp`` where it keeps the master's last word (None: it keeps none)."""
    env = {
        **os.environ,
        "POD_IP": store.host,
        MASTER_HTTP_ENV: f"http://{through}:{master.metrics_port}",
        STORE_PORT_ENV: str(store.port),
        **({} if memory is None else {MEMORY_ENV: str(memory)}),
    }
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def frozen(master: MooncakeMaster) -> Iterator[None]:
    """The master stopped (SIGSTOP): it accepts connections and answers nothing until thawed."""
    assert master.process is not None
    os.kill(master.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(master.process.pid, signal.SIGCONT)


STANDBY = "127.0.0.6"


@contextlib.contextmanager
def standby_naming(leader: str, port: int) -> Iterator[None]:
    """A stand-in HA standby master at ``STANDBY``:``port``: its ``/health`` names ``leader``,
    everything else is 404 (as a standby knows no segment)."""
    with health_server(
        STANDBY, port, lambda: {"role": "standby", "service_ready": False, "leader_address": leader}
    ):
        yield


def stop_unmounted(master: MooncakeMaster, store: MooncakeStore, timeout: float = 30) -> None:
    """Stop ``store`` and wait until the master no longer counts its segment."""
    store.stop()
    deadline = time.monotonic() + timeout
    while store.host in segments_of(master) and time.monotonic() < deadline:
        time.sleep(0.2)


def fill(
    client: PoolClient, master: MooncakeMaster, stores: list[MooncakeStore], on_second: int
) -> dict[str, str]:
    """Objects 0-5 on store A (the only one then), then B started and ``on_second`` more on
    B; each store's segment by its host."""
    put(client, range(6))
    segments = start_second(master, stores)
    put(client, range(6, 6 + on_second), segments[HOSTS[1]])
    return segments


def start_second(master: MooncakeMaster, stores: list[MooncakeStore]) -> dict[str, str]:
    stores[1].start()
    wait_for_capacity(master, 30, minimum=2 * (64 << 20))
    segments = segments_of(master)
    assert set(segments) == set(HOSTS), segments
    return segments


@pytest.mark.mooncake
@pytest.mark.timeout(120)
def test_a_real_drain_moves_every_object_and_only_the_drained_store_turns_unready(
    two_stores: tuple[MooncakeMaster, list[MooncakeStore]], tmp_path: Path
) -> None:
    master, stores = two_stores
    base = f"http://127.0.0.1:{master.metrics_port}"
    kept_memory, drained_memory = (tmp_path / f"probe-{host}" for host in HOSTS)
    with bare_client(master.address) as client:
        segments = fill(client, master, stores, on_second=4)
        assert [probe(master, s).returncode for s in stores] == [0, 0]
        with frozen(master):  # no answer, and no word before it: ready
            assert probe(master, stores[1], memory=drained_memory).returncode == 0

        job_id = asyncio.run(create_drain_job(base, [segments[HOSTS[1]]], timeout=5))
        deadline = time.monotonic() + 60
        job = asyncio.run(query_drain_job(base, job_id, timeout=5))
        while not job.finished and time.monotonic() < deadline:
            time.sleep(0.2)
            job = asyncio.run(query_drain_job(base, job_id, timeout=5))
        assert job.status == "SUCCEEDED", job
        assert (job.moved_objects, job.moved_bytes) == (4, sum(len(value(i)) for i in range(6, 10)))
        with pytest.raises(DrainRefused):  # a finished job is not canceled
            asyncio.run(cancel_drain_job(base, job_id, timeout=5))

        drained = probe(master, stores[1], memory=drained_memory)
        kept = probe(master, stores[0], memory=kept_memory)
        assert drained.returncode == 1 and "is drained" in drained.stderr, drained
        assert kept.returncode == 0, kept
        assert drained_memory.read_text() == segments[HOSTS[1]] and not kept_memory.exists()
        # A master too slow to answer leaves its last word standing: the drained store stays
        # unready (the controller must still remove it, not the other), the other ready.
        with frozen(master):
            slow = probe(master, stores[1], memory=drained_memory)
            assert slow.returncode == 1 and "drained at the master's last answer" in slow.stderr, slow
            assert probe(master, stores[0], memory=kept_memory).returncode == 0
            # A remembered word is about the pod's own segment only.
            assert probe(master, stores[0], memory=drained_memory).returncode == 0
        # HA: the Service may answer from a standby, which knows no segment; the probe asks
        # the leader the standby names, on the same port (a stand-in standby at 127.0.0.6).
        with standby_naming(f"127.0.0.1:{master.rpc_port}", master.metrics_port):
            via_standby = probe(master, stores[1], through=STANDBY)
            assert via_standby.returncode == 1 and "is drained" in via_standby.stderr, via_standby
            assert probe(master, stores[0], through=STANDBY).returncode == 0
        put(client, range(10, 16))  # written after the drain: none may go to B

        stop_unmounted(master, stores[1])  # the ReplicaSet controller removes the unready pod
        assert missing(client, range(16)) == []

        # A store restarted in the same pod (its /tmp kept) mounts a segment the master has
        # not drained: that word replaces the remembered one, and the store is ready again.
        stores[1].start(master)
        wait_for_capacity(master, 30, minimum=2 * (64 << 20))
        again = probe(master, stores[1], memory=drained_memory)
        assert again.returncode == 0, again
        assert not drained_memory.exists()


@pytest.mark.mooncake
@pytest.mark.timeout(120)
def test_without_a_drain_stopping_a_store_loses_what_it_held(
    two_stores: tuple[MooncakeMaster, list[MooncakeStore]],
) -> None:
    """The negative control: the check above can see a loss."""
    master, stores = two_stores
    with bare_client(master.address) as client:
        fill(client, master, stores, on_second=4)
        stop_unmounted(master, stores[1])
        assert missing(client, range(10)) == [6, 7, 8, 9]


@pytest.mark.mooncake
@pytest.mark.timeout(120)
def test_the_timer_steps_drain_the_emptiest_store_and_give_a_canceled_one_back(
    two_stores: tuple[MooncakeMaster, list[MooncakeStore]],
) -> None:
    """``drain_timer.advance`` against the real master: Pending -> Draining -> Drained on the
    emptiest store; a drain called off before it finished gives its segment back (the probe
    says ready again)."""
    master, stores = two_stores
    base = f"http://127.0.0.1:{master.metrics_port}"
    with bare_client(master.address) as client:
        segments = fill(client, master, stores, on_second=2)
        pods = {HOSTS[0]: "pool-store-a", HOSTS[1]: "pool-store-b"}
        seen = asyncio.run(poll_master([base], now=T0, timeout=5, store_pods=pods))
        pending = new_record(state=PENDING, from_replicas=2, to_replicas=1, started_at=T0, deadline=LATE)
        draining = asyncio.run(advance(pending, seen, base, T0, 5))
        assert draining is not None and draining.state == DRAINING and draining.job_id
        assert (draining.segments, draining.pods) == ([segments[HOSTS[1]]], ["pool-store-b"])
        record: StoreDrainStatus | None = draining
        deadline = time.monotonic() + 60
        while record is not None and record.state == DRAINING and time.monotonic() < deadline:
            time.sleep(0.2)
            record = asyncio.run(advance(record, seen, base, T1, 5))
        assert record is not None and record.state == DRAINED, record
        assert record.moved_objects == 2 and probe(master, stores[1]).returncode == 1

        # A drain withdrawn before it finishes: a job on A that cannot finish (B takes no
        # writes, so A's objects have nowhere to go) is canceled, and A is ready again.
        job_id = asyncio.run(create_drain_job(base, [segments[HOSTS[0]]], timeout=5))
        withdrawn = pending.model_copy(update={"state": WITHDRAWN, "job_id": job_id})
        assert asyncio.run(advance(withdrawn, seen, base, T1, 5)) is None
        status = urllib.request.urlopen(
            f"{base}/api/v1/segments/status?segment={segments[HOSTS[0]]}", timeout=5
        ).read()
        assert b'"status_name":"OK"' in status, status
        assert probe(master, stores[0]).returncode == 0
        assert missing(client, range(8)) == []


# --- The timer's steps where a real master cannot be made to answer so ----------------------
# A stand-in for the master's admin API (a real master refuses a cancel only while a move is
# in flight, and fails a job only when objects cannot move: neither can be timed here).


class FakeAdmin:
    """Answers ``/api/v1/drain_jobs/query`` with ``job`` and ``/cancel`` with ``cancel_ok``."""

    def __init__(self, job: dict[str, Any], cancel_ok: bool = True):
        self.job, self.cancel_ok = job, cancel_ok
        self.canceled: list[str] = []

    async def query(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True, "job_id": request.query["job_id"], **self.job})

    async def cancel(self, request: web.Request) -> web.Response:
        self.canceled.append(request.query["job_id"])
        if not self.cancel_ok:
            return web.json_response(
                {"success": False, "error_code": -708, "error_message": "busy"}, status=400
            )
        return web.json_response({"success": True, "job_id": request.query["job_id"], "status": "CANCELED"})


async def step(admin: FakeAdmin, record: StoreDrainStatus, now: str) -> StoreDrainStatus | None:
    app = web.Application()
    app.router.add_get("/api/v1/drain_jobs/query", admin.query)
    app.router.add_post("/api/v1/drain_jobs/cancel", admin.cancel)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        return await advance(record, None, f"http://127.0.0.1:{port}", now, 5)
    finally:
        await runner.cleanup()


RUNNING = {"status_name": "RUNNING", "succeeded_units": 2, "active_units": 1, "migrated_bytes": 2 << 20}
DRAINING_RECORD = new_record(
    state=DRAINING, from_replicas=2, to_replicas=1, started_at=T0, deadline=T1, job_id="j-1", pods=["b"]
)
JUST_LATE = "2026-12-03T10:01:30Z"  # past the deadline, within the cancel's grace


@pytest.mark.asyncio
async def test_a_drain_past_its_deadline_is_canceled_and_given_up() -> None:
    admin = FakeAdmin(RUNNING)
    assert (await step(admin, DRAINING_RECORD, T0)).state == DRAINING  # type: ignore[union-attr]
    assert admin.canceled == []
    late = await step(admin, DRAINING_RECORD, JUST_LATE)
    assert late is not None and late.state == GIVEN_UP and late.moved_objects == 2
    assert admin.canceled == ["j-1"] and "the job is canceled" in late.message


@pytest.mark.asyncio
async def test_a_refused_cancel_is_asked_again_then_given_up() -> None:
    admin = FakeAdmin(RUNNING, cancel_ok=False)
    again = await step(admin, DRAINING_RECORD, JUST_LATE)
    assert again is not None and again.state == DRAINING and "canceling" in again.message
    over = await step(admin, DRAINING_RECORD, LATE)
    assert over is not None and over.state == GIVEN_UP and "did not cancel" in over.message
    assert admin.canceled == ["j-1", "j-1"]


@pytest.mark.asyncio
async def test_a_failed_job_gives_up_without_a_cancel() -> None:
    admin = FakeAdmin({"status_name": "FAILED", "failed_units": 3, "message": "unrecoverable units remain"})
    failed = await step(admin, DRAINING_RECORD, T0)
    assert failed is not None and failed.state == GIVEN_UP and "ended FAILED" in failed.message
    assert admin.canceled == []


@pytest.mark.asyncio
async def test_a_drain_called_off_after_its_job_finished_goes_on_as_drained() -> None:
    withdrawn = DRAINING_RECORD.model_copy(update={"state": WITHDRAWN})
    admin = FakeAdmin({"status_name": "SUCCEEDED", "succeeded_units": 4, "migrated_bytes": 4 << 20})
    done = await step(admin, withdrawn, T0)
    assert done is not None and done.state == DRAINED and done.moved_objects == 4
    assert done.deadline == "2026-12-03T10:01:00Z"  # at least a minute for the pods to turn unready
    assert admin.canceled == []
    running = FakeAdmin(RUNNING)
    assert await step(running, withdrawn, T0) is None and running.canceled == ["j-1"]


# --- On the emulated API: which store pods a pass and a poll count ----------------------------


def store_pod(name: str, ip: str, phase: str, ready: bool) -> dict[str, Any]:
    return pool_pod(name, ip, STORE, phase=phase, ready=ready)


@pytest.mark.asyncio
async def test_an_evicted_store_pod_holds_no_scale_down_and_names_no_segment(
    cluster: Cluster, tmp_path: Path
) -> None:
    """An evicted store pod stays in the API (phase Failed) with the IP it had, which the node
    may have given to a new store pod. The ReplicaSet controller counts it no more: it is no
    staying store that is not ready (the drained scale-down goes on at once, without a
    warning), and a segment at that IP is the live pod's."""
    await cluster.create(store_pod("pool-store-0", "10.0.0.1", "Running", ready=True))
    await cluster.create(store_pod("pool-store-1", "10.0.0.2", "Running", ready=False))  # drained
    await cluster.create(store_pod("pool-store-old", "10.0.0.2", "Failed", ready=False))  # evicted
    drained = new_record(
        state=DRAINED, from_replicas=2, to_replicas=1, started_at=T0, deadline=LATE, pods=["pool-store-1"]
    )
    plan = plan_of(1)
    configuration = await load_configuration(str(write_kubeconfig(tmp_path / "kubeconfig", cluster.url)))
    async with ApiClient(configuration) as api:
        reconciler = Reconciler(
            KubeClient(api, timeout=10.0), OperatorMetrics(), POLICY, UNSERVED_MASTER_HEALTH_URL
        )
        scale = await store_scale_of(reconciler.kube, plan, "uid", {"storeDrain": dump(drained)}, None, T1)
        seen = await reconciler.poll(plan)  # nothing answers: the store pods by IP are kept all the same
    assert (scale.replicas, scale.drain, scale.unready_kept, scale.warns) == (1, None, (), False)
    assert dict(seen.store_pods) == {"10.0.0.1": "pool-store-0", "10.0.0.2": "pool-store-1"}


def test_the_operators_gauge_shows_a_drain_while_it_waits() -> None:
    from prometheus_client import generate_latest

    from kvpool.operator.metrics import OperatorMetrics

    metrics = OperatorMetrics()
    draining = {"phase": "Ready", "storeDrain": {"state": "Draining", "fromReplicas": 2, "toReplicas": 1}}
    metrics.observe_pool("ns", "pool", draining)
    line = 'kvpool_operator_pool_store_drain{namespace="ns",pool="pool",state="Draining"} 1.0'
    assert line in generate_latest(metrics.registry).decode()
    metrics.observe_pool("ns", "pool", {"phase": "Ready"})
    assert "kvpool_operator_pool_store_drain{" not in generate_latest(metrics.registry).decode()


def test_kubectl_get_shows_a_drain_that_waits() -> None:
    from kvpool.operator.crd import build_crd

    (version,) = build_crd()["spec"]["versions"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Store drain"] == ".status.storeDrain.state"
    schema = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    states = schema["storeDrain"]["properties"]["state"]["enum"]
    assert set(states) == {PENDING, DRAINING, DRAINED, GIVEN_UP, WITHDRAWN}


# --- Through the operator, restarted: its polls are kept in memory only ----------------------


def stand_in_master_text(*ips: str) -> str:
    """A master's ``/metrics`` naming one 1 GiB segment per store pod at ``ips``, the first
    emptiest."""
    lines = ["# TYPE segment_allocated_bytes gauge"]
    lines += [f'segment_allocated_bytes{{segment="{ip}:15000"}} {i << 20}' for i, ip in enumerate(ips)]
    lines += ["# TYPE segment_total_capacity_bytes gauge"]
    lines += [f'segment_total_capacity_bytes{{segment="{ip}:15000"}} {1 << 30}' for ip in ips]
    lines += [f"master_total_capacity_bytes {len(ips) << 30}", f"master_allocated_bytes {len(ips) << 20}"]
    lines += ["master_key_count 3", ""]
    return "\n".join(lines)


@pytest.mark.asyncio
async def test_a_restarted_operator_drains_a_scale_down_it_finds_before_its_first_poll(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The master's last answer lives in the operator's memory: a new process (restarted, or a
    standby that took the Lease over) has none until its first poll. Its first passes find a
    scale-down asked for while it was away; they hold the store count until the master was
    asked (a master that could not be asked would leave no drain to wait for), then the
    leaving pods drain first. They never apply the lower count undrained.

    The master is a stand-in (``/health`` and ``/metrics`` over loopback, no drain API): no
    real one runs behind the emulated API. Its first answer is held until the new operator
    has made several passes."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    answer = asyncio.Event()

    async def health(_: web.Request) -> web.Response:
        await answer.wait()
        return web.json_response({"role": "leader", "service_ready": True})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=stand_in_master_text("10.0.0.1", "10.0.0.2"))

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", cluster.url)

    def options() -> OperatorOptions:
        return OperatorOptions(
            **quick_options(
                kubeconfig,
                policy=POLICY,
                master_health_url=f"http://127.0.0.1:{port}/health",
                observe_timeout=30.0,  # the held answer is no timeout
            )
        )

    def store_replicas() -> Any:
        return (cluster.get(DEPLOYMENTS_PATH, "pool-store") or {}).get("spec", {}).get("replicas")

    try:
        for i in range(2):
            await cluster.create(store_pod(f"pool-store-{i}", f"10.0.0.{i + 1}", "Running", ready=True))
        await cluster.create(pool_manifest(spec=pool_spec(store={"segmentSize": "1GB", "replicas": 2})))
        async with running_operator(cluster, options()):
            await eventually(lambda: store_replicas() == 2, what="two store replicas")
        await cluster.patch_pool("pool", {"spec": {"store": {"replicas": 1}}})
        start = cluster.mark()
        async with running_operator(cluster, options()):
            await cluster.passes("pool", start, count=4)  # the master not asked yet
            answer.set()
            drain = await eventually(
                lambda: cluster.pool_status("pool").get("storeDrain") or store_replicas() != 2,
                what="a drain, or the store count applied",
            )
            assert store_replicas() == 2, "applied undrained, before the master was ever asked"
            assert drain["state"] == PENDING and (drain["fromReplicas"], drain["toReplicas"]) == (2, 1)
        assert "lastScaleDown" not in cluster.pool_status("pool")
        assert cluster.events("StoreScaleDown") == []
    finally:
        await runner.cleanup()
