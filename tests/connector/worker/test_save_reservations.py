"""A save that finds its key reserved by another writer stores nothing and says so (real Mooncake).

Mooncake answers a reservation of a key that another writer reserved and has not
published (a TP rank's save in flight, or a rank killed in the middle of one: Mooncake
drops that reservation after about 30 s) exactly as it answers one of a published key.
Only the published key holds the block; the other is a save that did not happen. It must
not count as stored, nor be announced to routers as stored (no lookup can hit it).

A removal (a save replacing what a failed load read, or a corrupt object) never takes a
key that a save of the same client is writing: Mooncake drops an object removed between
its write and its publish, and the publish still answers success.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.connector.contract.keys import KeySpace
from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestSave
from kvpool.connector.observability.pool_events import STORED, ObservedClient, WorkerReports
from kvpool.connector.observability.records import StatsCollector
from kvpool.connector.pool_client import (
    CODE_KEPT_WRITING,
    CODE_OBJECT_EXISTS,
    CODE_RESERVED_ELSEWHERE,
    Outcome,
    classify,
    open_client,
)
from kvpool.connector.worker.side import WorkerSide
from testing.mooncake_faults import mooncake_store_class
from tests.connector.worker.test_worker_transfer import GROUP_LAYERS, NUM_BLOCKS, make_caches

pytestmark = pytest.mark.mooncake

DIGEST = "d" * 32


@pytest.fixture
def other_writer(pool_settings):
    """A second client: another engine's rank, saving the same block."""
    client = open_client(pool_settings, global_segment_size=0)
    yield client
    client.close()


def reserve_without_publishing(client, key: str, size: int) -> np.ndarray:
    buf = np.zeros(size, dtype=np.uint8)
    client.register(buf.ctypes.data, buf.nbytes)
    assert client.reserve([key], [size]) == [0]
    assert client.write([key], [[buf.ctypes.data]], [[size]], [[0]]) == [size]
    return buf


def test_a_key_reserved_elsewhere_is_not_a_stored_block(pool_client, other_writer, cache_prefix) -> None:
    keyspace = KeySpace(cache_prefix, "fp")
    reports = WorkerReports(rank=0)
    worker = WorkerSide(
        client=ObservedClient(pool_client, reports),
        keyspace=keyspace,
        tp_rank=0,
        pp_rank=0,
        group_layers=GROUP_LAYERS,
        num_blocks=NUM_BLOCKS,
        stats=StatsCollector(group_kinds=("full", "sliding_window")),
    )
    worker.register_kv_caches(make_caches())
    key = keyspace.key(0, 0, 0, DIGEST)
    size = worker.copiers[0].object_bytes
    try:
        _buf = reserve_without_publishing(other_writer, key, size)

        def save() -> object:
            one_block = RequestSave("r", [GroupTransfer(0, [DIGEST], [1])])
            worker.start_saves(PoolConnectorMetadata(saves=[one_block]))
            worker.before_forward()
            worker.wait_for_saves()
            (record,) = worker.stats.drain()[1]
            return record

        record = save()
        assert record.blocks == (0,)
        assert record.failures == {Outcome.IN_FLIGHT.value: 1}
        assert reports.take() is None  # nothing announced as stored
        assert pool_client.exists([key]) == [False]

        # Once the other writer publishes, the block is in the pool: this save counts it stored.
        assert other_writer.publish([key]) == [0]
        record = save()
        assert record.blocks == (1,) and record.failures == {}
        stored = reports.take()
        assert stored is not None and stored.get_all_events() == [(STORED, 0, DIGEST, 0)]
    finally:
        worker.shutdown()


def test_reservation_codes(pool_client, other_writer, cache_prefix) -> None:
    key = f"{cache_prefix}/k"
    _buf = reserve_without_publishing(other_writer, key, 64)
    assert pool_client.reserve([key], [64]) == [CODE_RESERVED_ELSEWHERE]
    assert classify(CODE_RESERVED_ELSEWHERE) is Outcome.IN_FLIGHT
    assert other_writer.publish([key]) == [0]
    assert pool_client.reserve([key], [64]) == [CODE_OBJECT_EXISTS]


def publish_one(client, key: str, size: int) -> np.ndarray:
    buf = reserve_without_publishing(client, key, size)
    assert client.publish([key]) == [0]
    return buf  # registered with the client: kept until the test ends


def test_a_removal_leaves_the_object_a_save_here_is_writing(
    pool_client, cache_prefix, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests of one engine whose loads of the same blocks failed both save them again,
    each removing what the pool holds first. A removal that reached the master after the other
    save's publish, before that publish's answer, took the new object: the publish answered 0
    and the key was empty. (Found chasing a rare run of ``test_failed_load_saves`` whose
    consumer took 4 of 10 blocks: two threads of one client replacing the same keys lost
    them once in 400 tries.) Until its publish answers, the key is the save's."""
    writing, stale = f"{cache_prefix}/writing", f"{cache_prefix}/stale"
    bufs = [publish_one(pool_client, stale, 64), reserve_without_publishing(pool_client, writing, 64)]
    store_class = mooncake_store_class()
    end_session = store_class.batch_put_session_end
    removal: dict[str, list[int]] = {}

    def publishing(store, keys):
        codes = end_session(store, keys)
        removal["codes"] = pool_client.remove([writing, stale])  # the other save's, meanwhile
        return codes

    monkeypatch.setattr(store_class, "batch_put_session_end", publishing)
    assert pool_client.publish([writing]) == [0]
    monkeypatch.undo()
    assert pool_client.exists([writing, stale]) == [True, False], f"published, then removed: {removal}"
    assert removal["codes"] == [CODE_KEPT_WRITING, 0]
    del bufs


def test_a_reservation_while_a_removal_runs_is_left_to_the_remover(
    pool_client, cache_prefix, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another save of this client reserving and writing a key while its removal is inside
    Mooncake would lose its object the same way: it is refused as in flight elsewhere, and the
    remover's own save stores the key."""
    key = f"{cache_prefix}/replaced"
    bufs = [publish_one(pool_client, key, 64)]
    store_class = mooncake_store_class()
    remove = store_class.batch_remove
    other_save: dict[str, list[int]] = {}

    def removing(store, keys, force):
        buf = np.zeros(64, dtype=np.uint8)
        bufs.append(buf)
        pool_client.register(buf.ctypes.data, buf.nbytes)
        codes = other_save["reserved"] = pool_client.reserve([key], [64])
        if codes == [0]:
            pool_client.write([key], [[buf.ctypes.data]], [[64]], [[0]])
        answer = remove(store, keys, force)
        if codes == [0]:
            other_save["published"] = pool_client.publish([key])
        return answer

    monkeypatch.setattr(store_class, "batch_remove", removing)
    assert pool_client.remove([key]) == [0]
    monkeypatch.undo()
    if other_save.get("published") == [0]:
        assert pool_client.exists([key]) == [True], "a save published, and its key is empty"
    # Not "exists" (counted stored, announced to routers) for a key the removal then takes.
    assert other_save["reserved"] == [CODE_RESERVED_ELSEWHERE]
    bufs.append(publish_one(pool_client, key, 64))  # the remover's save
    assert pool_client.exists([key]) == [True]
