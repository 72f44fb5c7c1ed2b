"""Worker-side transfers through a real Mooncake pool, byte for byte.

The cache tensors mimic vLLM's: one tensor per layer, ``(2, num_blocks, ...)``
(K and V apart), and layers of different groups sharing one tensor as vLLM's
hybrid allocator does on CPU.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvpool.connector.contract.keys import KeySpace
from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestLoad, RequestSave
from kvpool.connector.observability.records import StatsCollector
from kvpool.connector.pool_client import Outcome, classify
from kvpool.connector.worker.side import WorkerSide
from testing.worker import run_loads, single_group_worker, staging_slots, transfer_threads

pytestmark = pytest.mark.mooncake

NUM_BLOCKS = 16
SHAPE = (2, NUM_BLOCKS, 32, 2, 16)  # K/V, blocks, tokens, heads, head size


def make_caches() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shared = torch.randn(SHAPE, generator=gen)
    return {
        "l0": shared,  # group 0
        "l1": shared,  # group 1, same memory as l0 (hybrid allocator)
        "l2": torch.randn(SHAPE, generator=gen),  # group 0
        "l3": torch.randn(SHAPE, generator=gen),  # group 1
    }


GROUP_LAYERS = [["l0", "l2"], ["l1", "l3"]]


def two_group_worker(pool_client, cache_prefix, **options) -> WorkerSide:
    """A worker of ``GROUP_LAYERS`` (a full and a window group), its caches not registered."""
    return WorkerSide(
        client=pool_client,
        keyspace=KeySpace(cache_prefix, "fp"),
        tp_rank=0,
        pp_rank=0,
        group_layers=GROUP_LAYERS,
        num_blocks=NUM_BLOCKS,
        stats=StatsCollector(group_kinds=("full", "sliding_window")),
        **options,
    )


@pytest.fixture
def worker(pool_client, cache_prefix):
    w = two_group_worker(pool_client, cache_prefix)
    caches = make_caches()
    w.register_kv_caches(caches)
    yield w, caches
    w.shutdown()


def wait_results(w: WorkerSide, req_id: str, timeout: float = 30.0) -> tuple[set, set]:
    deadline = time.monotonic() + timeout
    recving, failed = set(), set()
    while time.monotonic() < deadline:
        r, f = w.transfer_results()
        recving |= r
        failed |= f
        if req_id in recving:
            return recving, failed
        time.sleep(0.01)
    raise AssertionError(f"{req_id} never finished receiving")


def test_group_tables_hold_only_their_layers(worker) -> None:
    w, caches = worker
    bases = [[layer.base for layer in group] for group in w.groups]
    assert bases == [
        [caches["l0"].data_ptr(), caches["l2"].data_ptr()],
        [caches["l1"].data_ptr(), caches["l3"].data_ptr()],
    ]
    block_bytes = 2 * 32 * 2 * 16 * 4  # K and V of one block of one layer
    assert w.group_block_bytes(0) == w.group_block_bytes(1) == 2 * block_bytes


def test_save_then_load_moves_exact_bytes(worker) -> None:
    w, caches = worker
    save = RequestSave(
        "r1",
        [GroupTransfer(0, ["a", "b"], [1, 2]), GroupTransfer(1, ["c"], [3])],
    )
    w.start_saves(PoolConnectorMetadata(saves=[save]))
    w.before_forward()  # the barrier: saves have read their blocks
    w.wait_for_saves()  # ... and published them

    load = RequestLoad(
        "r2",
        [GroupTransfer(0, ["a", "b"], [5, 6]), GroupTransfer(1, ["c"], [7])],
        hit_tokens=64,
    )
    for name in ("l0", "l2", "l3"):
        caches[name][:, 5:8] = 0
    run_loads(w, [load])
    assert w.take_load_errors() == set()
    for name in ("l0", "l2"):
        assert torch.equal(caches[name][:, 5], caches[name][:, 1])
        assert torch.equal(caches[name][:, 6], caches[name][:, 2])
    for name in ("l1", "l3"):
        assert torch.equal(caches[name][:, 7], caches[name][:, 3])
    # Blocks outside the plan were not touched (l0 block 7 is group 1's write).
    _, transfers = w.stats.drain()
    save_rec, load_rec = transfers
    assert save_rec.blocks == (2, 1) and load_rec.blocks == (2, 1)
    assert load_rec.bytes == (2 * w.group_block_bytes(0), w.group_block_bytes(1))


def test_the_save_barrier_waits_for_copies_not_for_writes(worker, monkeypatch) -> None:
    """A save of two groups stages both before it writes either: the next step's barrier
    passes while the first group's write is still held in the pool (before, it waited for
    that write, and for a slow store up to a deadline per batch: the save was given up)."""
    from testing.mooncake_faults import Stall

    w, _ = worker
    stall = Stall("batch_put_from_multi_buffer_ranges").install(monkeypatch)
    save = RequestSave("r1", [GroupTransfer(0, ["a", "b"], [1, 2]), GroupTransfer(1, ["c"], [3])])
    w.start_saves(PoolConnectorMetadata(saves=[save]))
    w.before_forward()
    assert stall.returned == 0, "the barrier passed before any write returned"
    stall.release()
    w.wait_for_saves()
    monkeypatch.undo()
    keys = [w.keyspace.key(0, 0, 0, d) for d in ("a", "b")] + [w.keyspace.key(1, 0, 0, "c")]
    assert w.client.exists(keys) == [True] * 3, "the save was not given up: every object published"


def test_a_last_group_that_cannot_stage_never_holds_the_barrier_over_writes(worker, monkeypatch) -> None:
    """The blocks are released once the last group that can stage has copied: a group with
    block ids outside the cache (a bug, failed alone) never makes the barrier wait for the
    other groups' writes."""
    from testing.mooncake_faults import Stall

    w, _ = worker
    stall = Stall("batch_put_from_multi_buffer_ranges").install(monkeypatch)
    save = RequestSave("r1", [GroupTransfer(0, ["a"], [1]), GroupTransfer(1, ["c"], [NUM_BLOCKS + 5])])
    w.start_saves(PoolConnectorMetadata(saves=[save]))
    w.before_forward()
    assert stall.returned == 0, "the barrier passed before any write returned"
    assert not any(job.abandoned for job in w.jobs.live()), "the barrier waited for the write, then gave up"
    stall.release()
    w.wait_for_saves()
    monkeypatch.undo()
    assert w.client.exists([w.keyspace.key(0, 0, 0, "a"), w.keyspace.key(1, 0, 0, "c")]) == [True, False]


def test_a_save_given_up_while_it_writes_makes_no_more_calls(worker, monkeypatch) -> None:
    """A staged save given up at its deadline while one write hangs in the pool calls the pool
    no more (each further batch could hang as long, with the worker's transfers refused
    meanwhile), and publishes nothing."""
    from testing.mooncake_faults import Stall, mooncake_store_class

    w, _ = worker
    monkeypatch.setattr(w.client, "batch_size", 1)  # a batch per block
    stall = Stall("batch_put_session_start").install(monkeypatch)
    store_class = mooncake_store_class()
    stalled_start = store_class.batch_put_session_start
    starts: list[list[str]] = []

    def counted(store, keys, *args):
        starts.append(list(keys))
        return stalled_start(store, keys, *args)

    monkeypatch.setattr(store_class, "batch_put_session_start", counted)
    save = RequestSave("r1", [GroupTransfer(0, ["a", "b"], [1, 2]), GroupTransfer(1, ["c"], [3])])
    w.start_saves(PoolConnectorMetadata(saves=[save]))
    w.before_forward()  # every group staged: the barrier passes
    deadline = time.monotonic() + 10
    while stall.stalled == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stall.stalled == 1, "the first batch's reservation hangs"
    (job,) = [j for j in w.jobs.live() if j.kind == "save"]
    job.abandon()
    stall.release()
    w.wait_for_saves()
    deadline = time.monotonic() + 10
    while w.jobs.live() and time.monotonic() < deadline:
        time.sleep(0.01)
    monkeypatch.undo()
    assert len(starts) == 1, f"calls after the save was given up: {starts[1:]}"
    keys = [w.keyspace.key(0, 0, 0, d) for d in ("a", "b")] + [w.keyspace.key(1, 0, 0, "c")]
    assert w.client.exists(keys) == [False] * 3, "nothing published"


def test_empty_load_finishes_at_once(worker) -> None:
    """Regression: a request whose every block is masked out must not hang."""
    w, _ = worker
    load = RequestLoad("empty", [GroupTransfer(0), GroupTransfer(1)], hit_tokens=32)
    w.start_loads(PoolConnectorMetadata(loads=[load]))
    recving, failed = wait_results(w, "empty")
    assert "empty" in recving and not failed


def test_missing_keys_fail_the_hybrid_load(worker) -> None:
    w, caches = worker
    before = caches["l2"][:, 9].clone()
    load = RequestLoad("gone", [GroupTransfer(0, ["never-saved"], [9]), GroupTransfer(1)], hit_tokens=32)
    w.start_loads(PoolConnectorMetadata(loads=[load]))
    recving, failed = wait_results(w, "gone")
    assert "gone" in recving and "gone" in failed
    assert torch.equal(caches["l2"][:, 9], before)
    _, (record,) = w.stats.drain()
    assert record.failures == {"missing": 1}


def test_single_group_reports_failed_block_ids(pool_client, cache_prefix) -> None:
    w = single_group_worker(pool_client, cache_prefix, num_blocks=NUM_BLOCKS, fingerprint="fp1")
    try:
        caches = {"l0": torch.randn(SHAPE)}
        w.register_kv_caches(caches)
        w.start_saves(PoolConnectorMetadata(saves=[RequestSave("s", [GroupTransfer(0, ["x"], [1])])]))
        w.before_forward()
        w.wait_for_saves()
        load = RequestLoad("r", [GroupTransfer(0, ["x", "missing"], [4, 5])], hit_tokens=64)
        run_loads(w, [load])
        assert w.take_load_errors() == {5}
        assert torch.equal(caches["l0"][:, 4], caches["l0"][:, 1])
    finally:
        w.shutdown()


def test_a_load_is_reported_once(worker) -> None:
    """Finished receiving exactly once: for an aborted request that is what frees its blocks."""
    w, _ = worker
    load = RequestLoad("once", [GroupTransfer(0), GroupTransfer(1)], hit_tokens=32)
    w.start_loads(PoolConnectorMetadata(loads=[load]))
    wait_results(w, "once")
    assert w.transfer_results() == (set(), set())


@pytest.mark.parametrize(
    ("code", "expected", "outcome"),
    [
        (1024, 1024, Outcome.OK),
        (512, 1024, Outcome.TRANSFER_FAILED),
        (-704, None, Outcome.MISSING),
        (-200, None, Outcome.STORE_FULL),
        (-800, None, Outcome.TRANSFER_FAILED),
        (-900, None, Outcome.RPC_FAILED),
        (-600, None, Outcome.OTHER),
    ],
)
def test_classify(code, expected, outcome) -> None:
    assert classify(code, expected) is outcome


def test_a_broken_transfer_is_a_failure_not_an_exception(pool_client, cache_prefix) -> None:
    w = single_group_worker(pool_client, cache_prefix, num_blocks=NUM_BLOCKS, fingerprint="fp2")
    try:
        w.register_kv_caches({"l0": torch.randn(SHAPE)})
        # Block 999 does not exist: addressing it raises inside the worker.
        load = RequestLoad("r", [GroupTransfer(0, ["x"], [999])], hit_tokens=32)
        run_loads(w, [load])
        assert w.take_load_errors() == {999}
        (record,) = w.stats.transfers  # nothing drains it here
        assert record.failures == {"other_error": 1}
    finally:
        w.shutdown()


def test_an_engine_after_another_on_the_same_client_registers_its_memory(pool_client, cache_prefix) -> None:
    """The client outlives an engine in the process: the next engine's KV cache may reuse the
    freed memory in a span that overlaps the first one's, which Mooncake refuses to register
    (-600) while the first is still registered. Its loads must still work."""
    import numpy as np

    elements = int(np.prod(SHAPE))
    block = elements // (2 * NUM_BLOCKS)
    memory = np.random.default_rng(0).standard_normal(elements + block).astype(np.float32)
    # Two storages of their own over one allocation, the second one block further on.
    first_cache = torch.from_numpy(memory[:elements]).view(SHAPE)
    second_cache = torch.from_numpy(memory[block:]).view(SHAPE)
    first = single_group_worker(pool_client, cache_prefix, num_blocks=NUM_BLOCKS, fingerprint="fp3")
    first.register_kv_caches({"l0": first_cache})
    first.start_saves(PoolConnectorMetadata(saves=[RequestSave("s", [GroupTransfer(0, ["y"], [1])])]))
    first.before_forward()
    first.wait_for_saves()
    stored = first_cache[:, 1].clone()
    assert first.shutdown()
    second = single_group_worker(pool_client, cache_prefix, num_blocks=NUM_BLOCKS, fingerprint="fp3")
    try:
        second.register_kv_caches({"l0": second_cache})
        load = RequestLoad("r", [GroupTransfer(0, ["y"], [3])], hit_tokens=32)
        run_loads(second, [load])
        assert second.take_load_errors() == set()
        assert torch.equal(second_cache[:, 3], stored)
    finally:
        second.shutdown()


def test_a_refused_load_is_reported_failed_without_touching_anything(worker) -> None:
    """The scheduler refuses a load vLLM allocated other than planned: every worker reports
    it finished and failed (its request recomputes), and moves nothing."""
    w, caches = worker
    before = {name: t.clone() for name, t in caches.items()}
    load = RequestLoad("refused", [], hit_tokens=0, refused=True)
    finished, failed = run_loads(w, [load])
    assert finished == {"refused"} and failed == {"refused"}
    assert all(torch.equal(caches[name], before[name]) for name in caches)
    assert not w.stats.transfers, "nothing was transferred"


def test_shutdown_takes_a_finished_save_for_done_before_its_thread_returns(
    pool_client, cache_prefix, monkeypatch
) -> None:
    """A save that finished (its last call returned) while its thread has yet to leave is no
    call in flight: shutdown drains cleanly (a loaded machine once caught a thread there)."""
    import threading

    left = threading.Event()
    finished = threading.Event()
    original = WorkerSide._save_request

    def slow_to_leave(self, save) -> None:
        original(self, save)
        finished.set()
        left.wait(30)  # the thread not yet scheduled again after its job finished

    monkeypatch.setattr(WorkerSide, "_save_request", slow_to_leave)
    w = single_group_worker(pool_client, cache_prefix, num_blocks=NUM_BLOCKS)
    w.register_kv_caches({"l0": torch.randn(SHAPE)})
    try:
        w.start_saves(PoolConnectorMetadata(saves=[RequestSave("r", [GroupTransfer(0, ["d"], [1])])]))
        assert finished.wait(30)
        assert w.shutdown() is True, "a finished save is no call in flight"
    finally:
        left.set()


def _with_busy_transfer_threads(
    pool_client, cache_prefix, monkeypatch, blocks_per_save: int
) -> tuple[WorkerSide, list[RequestSave], list[str], threading.Event]:
    """A worker (shutdown drain 0.05 s) whose saves hold every transfer thread until the gate
    is set, two more queued behind them: (worker, its saves, those that ran, the gate)."""
    from kvpool.connector.worker.side import TRANSFER_THREADS, Deadlines

    gate = threading.Event()
    ran: list[str] = []

    def busy_save(self, save) -> None:
        ran.append(save.req_id)
        gate.wait(30)

    monkeypatch.setattr(WorkerSide, "_save_request", busy_save)
    w = single_group_worker(
        pool_client, cache_prefix, num_blocks=NUM_BLOCKS, deadlines=Deadlines(shutdown_s=0.05)
    )
    w.register_kv_caches({"l0": torch.randn(SHAPE)})
    n = blocks_per_save

    def group(i: int) -> GroupTransfer:
        return GroupTransfer(0, [f"d{i}-{b}" for b in range(n)], list(range(1 + n * i, 1 + n * i + n)))

    saves = [RequestSave(f"s{i}", [group(i)]) for i in range(TRANSFER_THREADS + 2)]
    w.start_saves(PoolConnectorMetadata(saves=saves))
    deadline = time.monotonic() + 30
    while len(ran) < TRANSFER_THREADS:
        assert time.monotonic() < deadline, "the transfer threads never started"
        time.sleep(0.01)
    return w, saves, ran, gate


def test_shutdown_forgets_transfers_that_never_started(pool_client, cache_prefix, monkeypatch) -> None:
    """Saves still queued behind busy transfer threads are cancelled at shutdown: they never
    ran, so once the busy ones return nothing is in flight (no call is reported stuck)."""
    from kvpool.connector.worker.side import TRANSFER_THREADS

    w, _, ran, gate = _with_busy_transfer_threads(pool_client, cache_prefix, monkeypatch, 1)
    try:
        assert w.shutdown() is False, "the busy saves are still in flight"
    finally:
        gate.set()
    deadline = time.monotonic() + 30
    while w.jobs.stalled:
        assert time.monotonic() < deadline, "a transfer that never started is still taken for stuck"
        time.sleep(0.01)
    assert w.shutdown() is True
    assert len(ran) == TRANSFER_THREADS, "the queued saves never ran"


def test_a_save_still_queued_at_shutdown_is_recorded_not_saved(
    pool_client, cache_prefix, monkeypatch
) -> None:
    """A save cancelled at shutdown (queued behind busy transfer threads past the drain) is
    in the records, its blocks failed at their deadline: every save asked for is accounted for."""
    w, saves, ran, gate = _with_busy_transfer_threads(pool_client, cache_prefix, monkeypatch, 2)
    try:
        w.shutdown()
    finally:
        gate.set()
    queued = {s.req_id for s in saves} - set(ran)
    records = {t.req_id: t for t in w.stats.transfers if t.operation == "save"}
    assert set(records) == queued, "each save that never started is recorded, once"
    for record in records.values():
        assert (record.blocks, record.failures) == ((0,), {Outcome.TIMEOUT.value: 2})
        assert record.group_attempted == (False,), "no latency or size for a save that never ran"


def test_get_finished_refuses_rather_than_report_a_failed_load_as_a_success() -> None:
    """vLLM's older ``get_finished`` has no way to say a load failed: a caller of it (vLLM
    0.32 calls ``get_transfer_results``) is told so at once, never handed a success."""
    pytest.importorskip("vllm")
    from kvpool.connector.connector import KVPoolConnector

    with pytest.raises(NotImplementedError, match="get_transfer_results"):
        KVPoolConnector.get_finished(object(), set())  # type: ignore[arg-type]


def test_a_worker_runs_the_transfer_threads_its_settings_name(pool_client, cache_prefix) -> None:
    w = single_group_worker(pool_client, cache_prefix, num_blocks=NUM_BLOCKS, transfer_threads=2)
    try:
        assert transfer_threads(w)._max_workers == 2 and w.retired_max == 2
    finally:
        w.shutdown()


@pytest.mark.parametrize("device_path", [None, True])
def test_staging_is_allocated_and_registered_with_the_kv_caches(
    pool_client, cache_prefix, monkeypatch, device_path
) -> None:
    """One buffer per transfer thread, sized from the settings, exists right after
    ``register_kv_caches``: on an accelerator the memory is taken at startup, never by a
    first transfer; transfers then allocate nothing."""
    registered: list[tuple[int, int]] = []
    register = type(pool_client).register
    monkeypatch.setattr(
        type(pool_client),
        "register",
        lambda self, ptr, size: registered.append((ptr, size)) or register(self, ptr, size),
    )
    w = single_group_worker(
        pool_client,
        cache_prefix,
        num_blocks=NUM_BLOCKS,
        transfer_threads=3,
        staging_bytes=1 << 20,
        device_path=device_path,
    )
    try:
        cache = torch.randn(SHAPE)
        w.register_kv_caches({"l0": cache})
        buffers = [(slot.ptr, slot.nbytes) for slot in staging_slots(w)]
        assert [size for _, size in buffers] == [1 << 20] * 3
        assert set(buffers) <= set(registered), "every buffer registered with Mooncake at once"
        w.start_saves(PoolConnectorMetadata(saves=[RequestSave("s", [GroupTransfer(0, ["a"], [1])])]))
        w.before_forward()
        w.wait_for_saves()
        run_loads(w, [RequestLoad("l", [GroupTransfer(0, ["a"], [2])], 32)])
        assert torch.equal(cache[:, 2], cache[:, 1])
        assert [(slot.ptr, slot.nbytes) for slot in staging_slots(w)] == buffers, (
            "no buffer allocated by a transfer"
        )
    finally:
        w.shutdown()


def test_on_the_device_path_every_group_is_copied_before_any_checksum(
    pool_client, cache_prefix, monkeypatch
) -> None:
    """On an accelerator a staged group's checksum waits for the transfer stream, and so for
    the step's forward queued before the copies: a save takes none before it has released the
    step's blocks, or the next step's barrier waits for this step's forward (CPU tensors on
    the device path: the order is what is checked, and the round trip)."""
    from kvpool.connector.worker.staging import StagingSlot
    from testing.worker import unreleased_saves

    w = two_group_worker(pool_client, cache_prefix, device_path=True)
    caches = make_caches()
    w.register_kv_caches(caches)
    held_at_sums: list[int] = []
    sums = StagingSlot.payload_word_sums

    def payload_word_sums(slot, indices, object_bytes):
        held_at_sums.append(sum(1 for job in unreleased_saves(w) if not job.blocks_released))
        return sums(slot, indices, object_bytes)

    monkeypatch.setattr(StagingSlot, "payload_word_sums", payload_word_sums)
    try:
        save = RequestSave("r1", [GroupTransfer(0, ["a", "b"], [1, 2]), GroupTransfer(1, ["c"], [3])])
        w.start_saves(PoolConnectorMetadata(saves=[save]))
        w.wait_for_saves()
        assert held_at_sums[:2] == [0, 0], held_at_sums  # both groups' sums after the release
        expected = [caches[n][:, b].clone() for n, b in (("l0", 1), ("l2", 2), ("l1", 3), ("l3", 3))]
        for tensor in {id(t): t for t in caches.values()}.values():
            tensor.zero_()
        load = RequestLoad("r2", [GroupTransfer(0, ["a", "b"], [1, 2]), GroupTransfer(1, ["c"], [3])], 96)
        assert run_loads(w, [load]) == ({"r2"}, set())
        got = [caches[n][:, b] for n, b in (("l0", 1), ("l2", 2), ("l1", 3), ("l3", 3))]
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    finally:
        w.shutdown()
