"""A save that finds its key reserved by another writer stores nothing and says so (real Mooncake).

Mooncake answers a reservation of a key that another writer reserved and has not
published (a TP rank's save in flight, or a rank killed in the middle of one: Mooncake
drops that reservation after about 30 s) exactly as it answers one of a published key.
Only the published key holds the block; the other is a save that did not happen. It must
not count as stored, nor be announced to routers as stored (no lookup can hit it).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.connector.contract.keys import KeySpace
from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestSave
from kvpool.connector.observability.pool_events import STORED, ObservedClient, WorkerReports
from kvpool.connector.observability.records import StatsCollector
from kvpool.connector.pool_client import (
    CODE_OBJECT_EXISTS,
    CODE_RESERVED_ELSEWHERE,
    Outcome,
    classify,
    open_client,
)
from kvpool.connector.worker.side import WorkerSide
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
