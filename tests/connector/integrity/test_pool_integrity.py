"""What an object is, and how long anything waits: a worker and a scheduler on a real pool.

* **Headers.** Objects that are not the block their key names (another layout, truncated,
  longer, random bytes of the right size, another block's object under this key) are
  failed loads: no byte reaches the blocks, the object is removed, the failure is
  counted ``corrupt``.
* **Deadlines.** Mooncake calls stalled at the client boundary (``testing.mooncake_faults``):
  a load past its deadline is failed and recomputed, and the stalled call, returning
  later and scribbling over what it was given, never writes a block; a save past its
  deadline publishes nothing; the save barrier and shutdown return; a lookup past its
  deadline is a miss, and lookups do not queue behind a stuck one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvpool.connector.contract import metric_names as m
from kvpool.connector.contract.keys import KeySpace
from kvpool.connector.contract.object_header import HEADER_BYTES
from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestLoad, RequestSave
from kvpool.connector.observability.records import StatsCollector
from kvpool.connector.observability.vllm_metrics import records_to_data, series_key
from kvpool.connector.scheduler.side import SchedulerSide
from kvpool.connector.worker.side import Deadlines, WorkerSide
from testing.host_copies import torn_copies
from testing.mooncake_faults import Stall
from testing.pool_store import put_bytes, raw_store
from testing.worker import loads_in_flight, resting_slots, retire_staging_slot, run_loads, staging_slot

pytestmark = pytest.mark.mooncake

NUM_BLOCKS = 16
SHAPE = (2, NUM_BLOCKS, 32, 2, 16)
# Passed only when a call is stalled, even on a busy machine.
FAST = Deadlines(load_s=2.0, save_s=2.0, shutdown_s=2.0)
BOUND_S = 30.0  # how long the tests poll for something that must happen


def make_worker(
    pool_client: Any, prefix: str, groups: int = 1, fingerprint: str = "fp", **options: Any
) -> WorkerSide:
    gen = torch.Generator().manual_seed(groups)
    layers = {f"l{i}": torch.randn(SHAPE, generator=gen) for i in range(2 * groups)}
    worker = WorkerSide(
        client=pool_client,
        keyspace=KeySpace(prefix, fingerprint),
        tp_rank=0,
        pp_rank=0,
        group_layers=[[f"l{2 * g}", f"l{2 * g + 1}"] for g in range(groups)],
        num_blocks=NUM_BLOCKS,
        stats=StatsCollector(group_kinds=("full", "sliding_window")[:groups]),
        deadlines=FAST,
        **options,
    )
    worker.register_kv_caches(layers)
    worker.caches = layers  # type: ignore[attr-defined]
    return worker


@pytest.fixture
def worker(pool_client: Any, cache_prefix: str) -> Iterator[WorkerSide]:
    w = make_worker(pool_client, cache_prefix)
    yield w
    w.shutdown()


def block(w: WorkerSide, block_id: int) -> list[torch.Tensor]:
    return [t[:, block_id].clone() for t in w.caches.values()]  # type: ignore[attr-defined]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def save(w: WorkerSide, digests: list[str], block_ids: list[int], req: str = "s") -> None:
    groups = [GroupTransfer(g, list(digests), list(block_ids)) for g in range(len(w.groups))]
    w.start_saves(PoolConnectorMetadata(saves=[RequestSave(req, groups)]))
    w.before_forward()
    w.wait_for_saves()


def load(
    w: WorkerSide, digests: list[str], block_ids: list[int], req: str = "l", *, wait: bool = True
) -> None:
    """Load ``digests`` into ``block_ids`` of every group; ``wait``: until it is reported."""
    groups = [GroupTransfer(g, list(digests), list(block_ids)) for g in range(len(w.groups))]
    request = RequestLoad(req, groups, hit_tokens=32 * len(digests))
    if wait:
        run_loads(w, [request])
    else:
        w.start_loads(PoolConnectorMetadata(loads=[request]))


def zero(w: WorkerSide, block_id: int) -> None:
    for t in w.caches.values():  # type: ignore[attr-defined]
        t[:, block_id] = 0


def records(w: WorkerSide, operation: str) -> list[Any]:
    return [t for t in w.stats.transfers if t.operation == operation]


def until(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


# --- headers --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case", ["another_layout", "truncated", "longer", "random_bytes", "misdirected", "stale_payload"]
)
def test_an_object_that_is_not_the_block_never_becomes_kv(
    case: str, worker: WorkerSide, pool_client: Any, cache_prefix: str
) -> None:
    save(worker, ["a", "b"], [1, 2])
    key = worker.keyspace.key(0, 0, 0, "a")
    store = raw_store(pool_client)
    stored = store.get(key)
    if case == "another_layout":
        other = make_worker(pool_client, cache_prefix, fingerprint="another-layout")
        try:
            save(other, ["a"], [1])
            bad = store.get(other.keyspace.key(0, 0, 0, "a"))
        finally:
            other.shutdown()
        assert len(bad) == len(stored), "same size: only the header tells them apart"
    elif case == "truncated":
        bad = stored[: len(stored) // 2]
    elif case == "longer":
        bad = stored + b"\0" * 64
    elif case == "random_bytes":
        bad = torch.randint(0, 256, (len(stored),), dtype=torch.uint8).numpy().tobytes()
    elif case == "stale_payload":  # its own header over other bytes: a read that overtook the write
        bad = stored[:HEADER_BYTES] + store.get(worker.keyspace.key(0, 0, 0, "b"))[HEADER_BYTES:]
    else:  # another block's object copied under this key
        bad = store.get(worker.keyspace.key(0, 0, 0, "b"))
    assert store.upsert(key, bad) == 0

    zero(worker, 5)
    before = block(worker, 5)
    worker.stats.drain()
    load(worker, ["a"], [5])
    assert worker.take_load_errors() == {5}, "a failed load: vLLM recomputes block 5"
    if case == "stale_payload":  # its header is the block's: copied, failed on the block, zeroed
        assert not any(t.any() for t in block(worker, 5)), "no byte of the object stays in the block"
    else:
        assert same(block(worker, 5), before), "no byte of an object with a wrong header reached the block"
    until(lambda: records(worker, "remove"), "the object is removed")
    (loaded,) = records(worker, "load")
    assert loaded.failures == {"corrupt": 1}
    (removed,) = records(worker, "remove")
    assert (removed.blocks, removed.reason) == ((1,), "corrupt")
    assert pool_client.exists([key]) == [False]
    # Stored again, it loads.
    save(worker, ["a"], [1])
    load(worker, ["a"], [5])
    assert worker.take_load_errors() == set() and same(block(worker, 5), block(worker, 1))


def test_a_staged_load_checks_the_block_not_the_buffer(worker: WorkerSide) -> None:
    """A copy out of the staging buffer that leaves the block unlike the object (a torn
    write) fails the load: the CRC-32C is taken from the block after its copy."""
    save(worker, ["a", "b"], [1, 2])
    for b in (5, 6):
        zero(worker, b)
    worker.stats.drain()
    with torn_copies():  # one bit of the block, not of the buffer
        load(worker, ["a", "b"], [5, 6])
    assert worker.take_load_errors() == {5, 6}, "neither block may be used or cached"
    assert not any(t.any() for b in (5, 6) for t in block(worker, b)), "both blocks zeroed"
    (loaded,) = records(worker, "load")
    assert (loaded.direct_blocks, loaded.failures) == (0, {"corrupt": 2 * len(worker.groups)})


# --- loads past their deadline ---------------------------------------------------------------


@pytest.mark.parametrize("returned", ["before_mooncakes_limit", "at_mooncakes_limit"])
def test_a_sync_load_past_its_deadline_fails_and_its_late_call_never_writes_a_block(
    returned: str, worker: WorkerSide, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stalled call returns before Mooncake's own limit (every transfer of it ended:
    its buffer is used again at once), or, as if cut off at that limit (its transport may
    still move bytes), its buffer rests and the next load takes another."""
    from kvpool.connector.worker import side as worker_side

    save(worker, ["a", "b"], [1, 2])
    if returned == "at_mooncakes_limit":  # (after the save, which would count too)
        monkeypatch.setattr(worker_side, "MOONCAKE_TRANSFER_WAIT_S", 0.0)
    stall = Stall("batch_get_into_multi_buffers", {worker.keyspace.key(0, 0, 0, "a")}, scribble=True)
    stall.install(monkeypatch)
    zero(worker, 5)
    before = block(worker, 5)
    load(worker, ["a"], [5])  # returns at the deadline, the call still stalled
    assert stall.in_flight == 1
    assert worker.take_load_errors() == {5}
    (late,) = records(worker, "load")
    assert late.failures == {"timeout": 1}
    # While a call the worker gave up on is stuck, new loads fail at once.
    load(worker, ["b"], [6], req="during")
    assert worker.take_load_errors() == {6}
    # The stalled call returns and scribbles over everything it was given ...
    stall.release()
    until(lambda: stall.in_flight == 0 and not worker.jobs.stalled, "the stalled call returns")
    # ... which was the staging buffer, never the block.
    assert same(block(worker, 5), before)
    retired = resting_slots(worker)
    assert len(retired) == (returned == "at_mooncakes_limit"), "only a call cut off at the limit rests"
    monkeypatch.undo()
    load(worker, ["b"], [6], req="after")
    assert worker.take_load_errors() == set() and same(block(worker, 6), block(worker, 2))
    assert resting_slots(worker) == retired, "a resting buffer stays resting"


def test_a_load_given_up_observes_its_wait_and_one_never_run_observes_none(
    worker: WorkerSide, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vllm:kvpool_operation_seconds of a load given up at its deadline is at least that
    deadline (it waited that long without progress), not 0; a load failed at once because a
    call is still stuck never ran, and observes no latency (nor transfer size)."""
    save(worker, ["a", "b"], [1, 2])
    stall = Stall("batch_get_into_multi_buffers", {worker.keyspace.key(0, 0, 0, "a")})
    stall.install(monkeypatch)
    worker.stats.drain()
    load(worker, ["a"], [5])  # given up at its deadline
    load(worker, ["b"], [6], req="during")  # failed at once: the board is stalled
    data = records_to_data([], records(worker, "load"))
    stall.release()
    until(lambda: stall.in_flight == 0 and not worker.jobs.stalled, "the stalled call returns")
    latencies = data["histograms"][series_key(m.OPERATION_SECONDS, operation="load", group_kind="full")]
    assert len(latencies) == 1 and latencies[0] >= FAST.load_s
    assert len(data["histograms"][series_key(m.TRANSFER_SIZE_BYTES, operation="load")]) == 1
    assert (
        data["counters"][
            series_key(m.FAILURES, group=0, group_kind="full", operation="load", reason="timeout")
        ]
        == 2
    )


def test_a_job_that_ran_to_mooncakes_limit_rests_its_buffer_even_if_never_given_up(
    worker: WorkerSide, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No step, nothing given up (a paused engine): a call may still end at Mooncake's own
    limit with bytes moving, so a job that ran that long rests its buffer. (The limit set to
    0: every job counts as one that reached it.)"""
    from kvpool.connector.worker import side as worker_side

    save(worker, ["a"], [1])
    before = resting_slots(worker)
    monkeypatch.setattr(worker_side, "MOONCAKE_TRANSFER_WAIT_S", 0.0)
    load(worker, ["a"], [5])
    assert worker.take_load_errors() == set() and same(block(worker, 5), block(worker, 1))
    assert len(resting_slots(worker)) == len(before) + 1


def test_loads_given_up_on_every_transfer_thread_at_once_leave_the_pool_serving(
    worker: WorkerSide, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frozen store: every transfer thread's load is given up on at its deadline, and the
    calls return when the store thaws, well before Mooncake's own limit. Each thread uses its
    buffer again at once. (Before, each buffer rested 600 s, and with as many resting as there
    are threads every load failed at once for ten minutes: chaos run of 2026-12-05.)"""
    save(worker, ["a", "b"], [1, 2])
    stall = Stall("batch_get_into_multi_buffers", {worker.keyspace.key(0, 0, 0, "a")}, scribble=True)
    stall.install(monkeypatch)
    threads = worker.transfer_threads
    targets = list(range(5, 5 + threads))
    for b in targets:
        zero(worker, b)
    before = [block(worker, b) for b in targets]
    run_loads(
        worker, [RequestLoad(f"frozen-{b}", [GroupTransfer(0, ["a"], [b])], hit_tokens=32) for b in targets]
    )
    assert stall.stalled == threads, "one call in flight on every transfer thread"
    assert worker.take_load_errors() == set(targets)
    stall.release()
    until(lambda: stall.in_flight == 0 and not worker.jobs.stalled, "the stalled calls return")
    assert all(same(block(worker, b), old) for b, old in zip(targets, before, strict=True))
    assert resting_slots(worker) == []
    monkeypatch.undo()
    worker.stats.drain()
    run_loads(
        worker, [RequestLoad(f"thawed-{b}", [GroupTransfer(0, ["b"], [b])], hit_tokens=32) for b in targets]
    )
    assert worker.take_load_errors() == set(), "every thread loads again"
    assert all(same(block(worker, b), block(worker, 2)) for b in targets)
    assert all(not r.failures for r in records(worker, "load"))


def test_a_buffer_given_up_on_rests_before_reuse(worker: WorkerSide, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool.connector.worker import side as worker_side

    first = staging_slot(worker)
    seen = [first]
    for _ in range(worker.retired_max - 1):
        retire_staging_slot(worker)
        fresh = staging_slot(worker)
        assert fresh is not None and all(fresh is not s for s in seen), "a resting buffer was reused"
        seen.append(fresh)
    retire_staging_slot(worker)
    assert staging_slot(worker) is None, "every spare buffer rests: no transfer until one may be used"
    monkeypatch.setattr(worker_side, "RETIRE_GRACE_S", 0.0)
    assert staging_slot(worker) is first, "after its rest the oldest buffer is used again"


# --- loads read ahead: the next batch into one half while the other is copied -----------------


def one_object_batches(worker: WorkerSide) -> None:
    """Read ahead one object at a time, so a load of n blocks reads n batches through both halves."""
    worker.load_batch_bytes = worker.copiers[0].object_bytes  # type: ignore[union-attr]


def test_a_load_read_ahead_batch_by_batch_moves_exact_bytes(
    worker: WorkerSide, monkeypatch: pytest.MonkeyPatch
) -> None:
    one_object_batches(worker)
    save(worker, ["a", "b", "c", "d", "e"], [1, 2, 3, 4, 5])
    for b in range(8, 13):
        zero(worker, b)
    load(worker, ["a", "b", "c", "d", "e"], [8, 9, 10, 11, 12])
    assert worker.take_load_errors() == set()
    for source, target in zip([1, 2, 3, 4, 5], [8, 9, 10, 11, 12], strict=True):
        assert same(block(worker, target), block(worker, source)), f"block {target}"
    (loaded,) = records(worker, "load")
    assert loaded.blocks == (5,) and not loaded.failures


def test_a_read_ahead_past_the_deadline_never_writes_a_block(
    worker: WorkerSide, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second batch's read, made while the first was copied, stalls: the load fails at its
    deadline with only the first block copied, and the stalled read, scribbling when it returns,
    reaches only its half of the staging buffer."""
    one_object_batches(worker)
    save(worker, ["a", "b", "c"], [1, 2, 3])
    stall = Stall("batch_get_into_multi_buffers", {worker.keyspace.key(0, 0, 0, "b")}, scribble=True)
    stall.install(monkeypatch)
    for b in (5, 6, 7):
        zero(worker, b)
    before = [block(worker, b) for b in (6, 7)]
    load(worker, ["a", "b", "c"], [5, 6, 7])  # returns at the deadline, the read still stalled
    assert stall.in_flight == 1
    assert worker.take_load_errors() == {6, 7}, "what was copied before the deadline stays loaded"
    assert same(block(worker, 5), block(worker, 1))
    stall.release()
    until(lambda: stall.in_flight == 0 and not worker.jobs.stalled, "the stalled read returns")
    assert all(same(block(worker, b), old) for b, old in zip((6, 7), before, strict=True))


def test_a_load_failing_midway_returns_only_after_its_read_ahead(
    worker: WorkerSide, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The staging buffer is the thread's again only when no read into it is in flight: a batch
    whose copy fails still waits for the next batch's read before the load returns."""
    from kvpool.connector.worker.staging import GroupCopier

    one_object_batches(worker)
    save(worker, ["a", "b"], [1, 2])
    stall = Stall("batch_get_into_multi_buffers", {worker.keyspace.key(0, 0, 0, "b")})
    stall.install(monkeypatch)
    copies: list[int] = []

    def failing_copy(self: GroupCopier, slot: Any, pairs: Any, headers: Any) -> list[int]:
        copies.append(len(pairs))
        raise RuntimeError("copy failed")

    monkeypatch.setattr(GroupCopier, "to_blocks_if_intact", failing_copy)
    load(worker, ["a", "b"], [5, 6], req="midway", wait=False)
    until(lambda: copies and stall.in_flight == 1, "the first copy failed with the next read in flight")
    future = loads_in_flight(worker)["midway"]
    time.sleep(0.5)  # room for a load that did not wait to return
    assert not future.done(), "returned while its read-ahead could still write the buffer"
    stall.release()
    until(future.done, "the load returns once its read-ahead did")
    assert stall.in_flight == 0


def test_an_async_load_past_its_deadline_is_reported_failed(
    pool_client: Any, cache_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = make_worker(pool_client, cache_prefix, groups=2)
    try:
        save(w, ["a"], [1])
        stall = Stall("batch_get_into_multi_buffers", {w.keyspace.key(1, 0, 0, "a")}, scribble=True)
        stall.install(monkeypatch)
        zero(w, 7)
        before = block(w, 7)
        load(w, ["a"], [7], req="hybrid", wait=False)
        finished: set[str] = set()
        failed: set[str] = set()

        def reported() -> bool:
            done, bad = w.transfer_results()
            finished.update(done)
            failed.update(bad)
            return "hybrid" in finished

        until(reported, "the load is reported")
        assert "hybrid" in failed, "the request recomputes"
        stall.release()
        until(lambda: not w.jobs.stalled, "the stalled call returns")
        # Group 0's block was loaded before the stall; group 1's never saw the scribble.
        assert same(block(w, 7)[2:], before[2:])
        assert any(r.failures.get("timeout") for r in records(w, "load"))
    finally:
        w.shutdown()


def test_a_single_group_async_load_past_its_deadline_hands_back_its_blocks(
    worker: WorkerSide, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A single-group layout: finished, not failed; vLLM gets the block ids."""
    save(worker, ["a"], [1])
    stall = Stall("batch_get_into_multi_buffers", {worker.keyspace.key(0, 0, 0, "a")}, scribble=True)
    stall.install(monkeypatch)
    zero(worker, 8)
    before = block(worker, 8)
    load(worker, ["a"], [8], req="single", wait=False)
    reported: list[tuple[set[str], set[str]]] = []
    until(lambda: reported.append(worker.transfer_results()) or "single" in reported[-1][0], "reported")
    assert "single" not in reported[-1][1]
    assert worker.take_load_errors() == {8}
    stall.release()
    until(lambda: not worker.jobs.stalled, "the stalled call returns")
    assert same(block(worker, 8), before)


# --- saves past their deadline ---------------------------------------------------------------


def test_a_save_past_its_deadline_publishes_nothing(
    worker: WorkerSide, pool_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = worker.keyspace.key(0, 0, 0, "late")
    stall = Stall("batch_put_from_multi_buffer_ranges", {key}).install(monkeypatch)
    worker.start_saves(PoolConnectorMetadata(saves=[RequestSave("s", [GroupTransfer(0, ["late"], [3])])]))
    worker.before_forward()  # the blocks are copied: the forward may go on
    worker.wait_for_saves()  # the save passes its deadline: abandoned
    assert stall.in_flight == 1
    assert pool_client.exists([key]) == [False], "a reserved object is invisible"
    stall.release()
    until(lambda: not worker.jobs.stalled, "the stalled write returns")
    assert pool_client.exists([key]) == [False], "abandoned: revoked, never published"
    (saved,) = records(worker, "save")
    assert saved.failures == {"timeout": 1} and saved.blocks == (0,)


def test_the_barrier_gives_up_on_a_save_that_could_not_start(
    worker: WorkerSide, pool_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every transfer thread stuck in the pool: a save queued behind them is abandoned at the
    barrier's deadline (and never reads its blocks); the stuck ones pass theirs, and every
    one of them publishes nothing."""
    stall = Stall("batch_put_from_multi_buffer_ranges").install(monkeypatch)
    saves = [RequestSave(f"s{i}", [GroupTransfer(0, [f"d{i}"], [1 + i])]) for i in range(5)]
    worker.start_saves(PoolConnectorMetadata(saves=saves))
    worker.before_forward()  # returns: four saves copied their blocks, the fifth is given up
    until(lambda: stall.in_flight == 4, "four saves stalled")
    # The stuck saves pass their own deadlines (each counts from its last progress, which
    # may come a little after the fifth's start), and the next forward's barrier gives
    # them up; only then does the pool answer.
    saves_left = [j for j in worker.jobs.live() if j.kind == "save" and not j.abandoned]
    until(lambda: all(j.overdue() for j in saves_left), "the stuck saves are past their deadlines")
    worker.before_forward()
    assert all(j.abandoned for j in saves_left)
    stall.release()
    worker.wait_for_saves()
    until(lambda: not worker.jobs.live(), "every save returned")
    assert stall.stalled == 4, "the fifth save never reached the pool"
    keys = [worker.keyspace.key(0, 0, 0, f"d{i}") for i in range(5)]
    assert pool_client.exists(keys) == [False] * 5
    assert [r.failures for r in records(worker, "save")] == [{"timeout": 1}] * 5


def test_shutdown_with_a_save_in_flight_returns_and_leaves_nothing_half_written(
    pool_client: Any, cache_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = make_worker(pool_client, cache_prefix)
    key = w.keyspace.key(0, 0, 0, "x")
    stall = Stall("batch_put_from_multi_buffer_ranges", {key}).install(monkeypatch)
    w.start_saves(PoolConnectorMetadata(saves=[RequestSave("s", [GroupTransfer(0, ["x"], [1])])]))
    until(lambda: stall.in_flight == 1, "the save is writing")
    assert w.shutdown() is False, "a call is still stuck in the pool"
    assert pool_client.exists([key]) == [False]
    stall.release()
    until(lambda: stall.in_flight == 0 and not w.jobs.live(), "the stalled write returns")
    assert pool_client.exists([key]) == [False], "abandoned at shutdown: never published"


# --- lookups past their deadline ---------------------------------------------------------------


def test_a_lookup_past_its_deadline_is_a_miss_and_lookups_do_not_pile_up(
    pool_client: Any, cache_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler's existence checks (its presence service's) against a stalled master call:
    none waits past its deadline, and none queues behind the stuck call."""
    sched = SchedulerSide(
        client=pool_client,
        keyspace=KeySpace(cache_prefix, "fp"),
        tp_size=1,
        pp_size=1,
        can_load=True,
        can_save=True,
        stats=StatsCollector(),
        lookup_timeout_s=0.2,
    )
    presence = sched.presence
    key = f"{cache_prefix}/present"
    assert put_bytes(pool_client, key, b"x") == 0
    try:
        assert presence.ask(lambda: [key]).result() == [True]
        stall = Stall("batch_is_exist").install(monkeypatch)
        assert presence.ask(lambda: [key]).result() is None, "no answer by the deadline"
        until(lambda: presence.stuck, "the stalled call is past its deadline")
        refused = presence.ask(lambda: [key])
        assert refused.done and refused.result() is None, "refused at once"
        assert stall.stalled == 1, "the second check did not queue behind the stuck one"
        stall.release()
        until(lambda: presence.ask(lambda: [key]).result() == [True], "checks answer again")
    finally:
        sched.close()
