"""Direct loads: objects in the worker's own segment copied straight into the blocks.

A worker whose client contributes memory keeps its saves there; loading them is a copy
within the process, which no frozen peer can stall, so it skips the staging buffer
(issue #32). The checksum is then taken from the blocks themselves: a corrupted object
is caught after its write, the load fails (vLLM recomputes the blocks) and the object is
removed. A load whose master call outlives its deadline never writes a block.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool.connector.contract.object_header import HEADER_BYTES
from kvpool.connector.worker.side import WorkerSide
from testing.host_copies import torn_copies
from testing.mooncake_faults import READ_METHOD, Stall, mooncake_store_class
from tests.connector.integrity.test_pool_integrity import (
    block,
    load,
    make_worker,
    records,
    same,
    save,
    until,
    zero,
)

pytestmark = pytest.mark.mooncake


@pytest.fixture
def own_client(pool_settings: Any) -> Iterator[Any]:
    """A client contributing a segment of its own, as an embedded pool's engine does."""
    from kvpool.connector.pool_client import open_client

    client = open_client(pool_settings, global_segment_size=64 << 20)
    yield client
    client.close()


@pytest.fixture
def co_located(own_client: Any, cache_prefix: str) -> Iterator[WorkerSide]:
    w = make_worker(own_client, cache_prefix, direct_local_loads=True)
    yield w
    w.shutdown()


def reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the keys every Mooncake read into a buffer names (the staged path's reads)."""
    store_class = mooncake_store_class()
    original = getattr(store_class, READ_METHOD)
    seen: list[int] = []

    def counted(store: Any, keys: Any, *args: Any) -> Any:
        seen.append(len(keys))
        return original(store, keys, *args)

    monkeypatch.setattr(store_class, READ_METHOD, counted)
    return seen


def test_objects_in_the_own_segment_load_straight_into_the_blocks(
    co_located: WorkerSide, monkeypatch: pytest.MonkeyPatch
) -> None:
    save(co_located, ["a", "b", "c"], [1, 2, 3])
    staged = reads(monkeypatch)
    for b in (8, 9, 10):
        zero(co_located, b)
    load(co_located, ["a", "b", "c"], [8, 9, 10])
    assert co_located.take_load_errors() == set()
    for source, target in zip([1, 2, 3], [8, 9, 10], strict=True):
        assert same(block(co_located, target), block(co_located, source)), f"block {target}"
    (loaded,) = records(co_located, "load")
    assert (loaded.blocks, loaded.direct_blocks, loaded.failures) == ((3,), 3, {})
    assert loaded.group_attempted == (True,), "its time counts in the group's load latency"
    assert staged == [], "no object went through a staging buffer"


def test_a_group_partly_in_the_own_segment_loads_those_directly_and_stages_the_rest(
    co_located: WorkerSide, pool_settings: Any, cache_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An embedded pool of several engines: of one group's objects, those in this process's
    segment are copied straight in, the one another engine's segment holds is read through
    the staging buffer, and every block ends up equal to what was saved."""
    from kvpool.connector.contract.keys import KeySpace
    from kvpool.connector.pool_client import open_client

    other_client = open_client(pool_settings, global_segment_size=64 << 20)
    other = make_worker(other_client, cache_prefix, direct_local_loads=True)
    try:
        save(co_located, ["a", "b"], [1, 2])
        save(other, ["c"], [3])  # kept in the other engine's segment
        keys = [KeySpace(cache_prefix, "fp").key(0, 0, 0, d) for d in ("a", "b", "c")]
        assert [at is not None for at in co_located.client.own_objects(keys)] == [True, True, False]
        staged = reads(monkeypatch)
        for b in (8, 9, 10):
            zero(co_located, b)
        load(co_located, ["a", "b", "c"], [8, 9, 10])
        assert co_located.take_load_errors() == set()
        for source, target in ((block(co_located, 1), 8), (block(co_located, 2), 9), (block(other, 3), 10)):
            assert same(block(co_located, target), source), f"block {target}"
        (loaded,) = records(co_located, "load")
        assert (loaded.blocks, loaded.direct_blocks, loaded.failures) == ((3,), 2, {})
        assert staged == [1], "only the other engine's object went through a staging buffer"
    finally:
        other.shutdown()
        other_client.close()


def test_a_worker_without_direct_loads_stages_the_same_objects(
    co_located: WorkerSide, own_client: Any, cache_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: with the setting off, the same objects arrive through the staging buffer."""
    staged_worker = make_worker(own_client, cache_prefix, direct_local_loads=False)
    try:
        save(co_located, ["y"], [5])
        staged = reads(monkeypatch)
        zero(staged_worker, 12)
        load(staged_worker, ["y"], [12])
        assert staged_worker.take_load_errors() == set()
        assert same(block(staged_worker, 12), block(co_located, 5))
        assert [r.direct_blocks for r in records(staged_worker, "load")] == [0]
        assert staged == [1], "the object was read into a staging buffer"
    finally:
        staged_worker.shutdown()


def corrupt_in_place(client: Any, key: str, offset: int = 0) -> None:
    """Flip bytes of ``key``'s payload where it lies in ``client``'s own segment (its header
    still names the block): memory gone bad after the object was written."""
    (at,) = client.own_objects([key])
    assert at is not None, "the object is in the client's own segment"
    address = at[0] + HEADER_BYTES + offset
    original = ctypes.string_at(address, 64)
    ctypes.memmove(address, bytes(b ^ 0xFF for b in original), 64)


def test_a_corrupted_own_object_is_caught_after_its_direct_write(
    co_located: WorkerSide, own_client: Any
) -> None:
    """Its bytes are written, caught on the block, and zeroed: vLLM frees a failed load's
    blocks for other requests, which write only the slots they compute (random bytes left
    in a block gave wrong answers in a chaos run; benchmarks/README.md, finding 17)."""
    save(co_located, ["a", "b"], [1, 2])
    key = co_located.keyspace.key(0, 0, 0, "b")
    corrupt_in_place(own_client, key)
    zero(co_located, 5)
    for t in co_located.caches.values():  # type: ignore[attr-defined]
        t[:, 6] = float("nan")  # whatever the block held before: not kept either
    load(co_located, ["a", "b"], [5, 6])
    assert co_located.take_load_errors() == {6}, "a failed load: vLLM recomputes block 6"
    assert same(block(co_located, 5), block(co_located, 1)), "the intact object loaded"
    assert all(not bool(b.any()) for b in block(co_located, 6)), "no byte of the object is left in block 6"
    (loaded,) = records(co_located, "load")
    assert (loaded.direct_blocks, loaded.failures) == (2, {"corrupt": 1})
    until(lambda: records(co_located, "remove"), "the object is removed")
    assert own_client.exists([key]) == [False]
    # Stored again, it loads.
    save(co_located, ["b"], [2])
    load(co_located, ["b"], [6])
    assert co_located.take_load_errors() == set() and same(block(co_located, 6), block(co_located, 2))


def test_the_check_reads_the_block_not_the_object(co_located: WorkerSide) -> None:
    """A copy that leaves the block unlike the intact object (a torn write) fails the load:
    the checksum is taken from the block after its copy, never from the object copied."""
    save(co_located, ["a", "b"], [1, 2])
    for b in (5, 6):
        zero(co_located, b)
    with torn_copies():  # one bit of the block, not of the object
        load(co_located, ["a", "b"], [5, 6])
    assert co_located.take_load_errors() == {5, 6}, "neither block may be used or cached"
    (loaded,) = records(co_located, "load")
    assert (loaded.direct_blocks, loaded.failures) == (2, {"corrupt": 2})


def test_a_direct_load_past_its_deadline_never_writes_a_block(
    co_located: WorkerSide, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The master call that finds the objects stalls (a frozen master): the load fails at its
    deadline, and when the call returns, nothing is copied."""
    save(co_located, ["a"], [1])
    stall = Stall("batch_get_replica_desc", {co_located.keyspace.key(0, 0, 0, "a")}).install(monkeypatch)
    zero(co_located, 7)
    before = block(co_located, 7)
    load(co_located, ["a"], [7])  # returns at the deadline, the call still stalled
    assert stall.in_flight == 1
    assert co_located.take_load_errors() == {7}
    stall.release()
    until(lambda: stall.in_flight == 0 and not co_located.jobs.stalled, "the stalled call returns")
    assert same(block(co_located, 7), before), "the late answer copied nothing"
    monkeypatch.undo()
    load(co_located, ["a"], [7], req="after")
    assert co_located.take_load_errors() == set() and same(block(co_located, 7), block(co_located, 1))
