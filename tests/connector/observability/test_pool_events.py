"""KV events for routers, in parts: the worker's report of what it published and removed (real
Mooncake), and the scheduler's events from plans and reports of every rank (vLLM's own
requests, configs and coordinator).

The whole path, with vLLM's OpenAI server publishing to a real ZMQ subscriber, is in
``tests/connector/local/test_serving_local_pool.py``.
"""

from __future__ import annotations

import pytest

from kvpool.connector.contract.keys import KeySpace, hash_digest
from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestSave
from kvpool.connector.observability.pool_events import (
    REMOVED,
    STORED,
    ObservedClient,
    PoolKeyReports,
    SchedulerEvents,
    WorkerReports,
)
from kvpool.connector.observability.records import StatsCollector
from testing.kv_cache import GroupDesc, make_coordinator, make_kv_cache_config
from testing.prompts import hashed_request

BLOCK = 32
TOKENS = [(7 * i + 3) % 500 for i in range(3 * BLOCK + 5)]  # three full blocks


@pytest.mark.mooncake
def test_a_worker_reports_the_keys_it_published_and_removed(pool_client, cache_prefix) -> None:
    import torch

    from kvpool.connector.worker.side import WorkerSide

    reports = WorkerReports(rank=1)
    client = ObservedClient(pool_client, reports)
    keyspace = KeySpace(cache_prefix, "fp")
    worker = WorkerSide(
        client=client,
        keyspace=keyspace,
        tp_rank=1,
        pp_rank=0,
        group_layers=[["l0"]],
        num_blocks=8,
        stats=StatsCollector(group_kinds=("full",)),
    )
    worker.register_kv_caches({"l0": torch.randn(2, 8, BLOCK, 1, 8)})
    try:
        save = RequestSave("r", [GroupTransfer(0, ["d0", "d1"], [1, 2])])
        worker.start_saves(PoolConnectorMetadata(saves=[save]))
        worker.before_forward()
        worker.wait_for_saves()
        taken = reports.take()
        assert taken is not None
        assert sorted(taken.get_all_events()) == [(STORED, 0, "d0", 1), (STORED, 0, "d1", 1)]
        assert reports.take() is None  # each report once

        # Saved again: the pool keeps the first object, which is the block: stored all the same.
        worker.start_saves(PoolConnectorMetadata(saves=[save]))
        worker.before_forward()
        worker.wait_for_saves()
        assert sorted(reports.take().get_all_events()) == [(STORED, 0, "d0", 1), (STORED, 0, "d1", 1)]

        key = keyspace.key(0, 1, 0, "d0")
        assert client.remove([key, keyspace.key(0, 1, 0, "absent")])[0] == 0
        assert reports.take().get_all_events() == [(REMOVED, 0, "d0", 1)]  # only what was removed
    finally:
        worker.shutdown()


def _scheduler(world_size: int) -> tuple[SchedulerEvents, object, object]:
    from kvpool.connector.scheduler.hybrid_hit import HybridHitCoordinator

    groups = [GroupDesc("full")]
    events = SchedulerEvents(make_kv_cache_config(groups), world_size)
    coordinator = HybridHitCoordinator.from_vllm_coordinator(make_coordinator(groups))
    return events, coordinator, hashed_request(TOKENS, BLOCK, request_id="req")


def _plan(events: SchedulerEvents, coordinator: object, request: object) -> list[str]:
    """A save plan for the request's three blocks (block ids 10, 11, 12); their digests."""
    digests = [hash_digest(bytes(h)) for h in request.block_hashes]
    save = RequestSave(request.request_id, [GroupTransfer(0, digests, [10, 11, 12])])
    events.track(request)
    events.on_saves_planned(PoolConnectorMetadata(saves=[save]), lambda _: ([10, 11, 12],), coordinator)
    return digests


def test_a_block_is_announced_once_every_rank_stored_it() -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    events, coordinator, request = _scheduler(world_size=2)
    digests = _plan(events, coordinator, request)
    hashes = [maybe_convert_block_hash(h) for h in request.block_hashes]

    events.on_reports(PoolKeyReports([(STORED, 0, d, 0) for d in digests]))
    assert events.take_events() == []  # rank 1 has not stored its keys yet
    events.on_reports(PoolKeyReports([(STORED, 0, digests[0], 0), (STORED, 0, digests[1], 1)]))
    (first,) = events.take_events()
    assert isinstance(first, BlockStored)
    assert first.block_hashes == [hashes[1]] and first.parent_block_hash == hashes[0]
    assert first.token_ids == TOKENS[BLOCK : 2 * BLOCK] and first.block_size == BLOCK
    assert (first.medium, first.locality, first.group_idx) == ("CPU", "REMOTE", 0)
    assert first.kv_cache_spec_kind == "full_attention"

    events.on_reports(PoolKeyReports([(STORED, 0, digests[0], 1), (STORED, 0, digests[2], 1)]))
    announced = events.take_events()
    assert [e.block_hashes for e in announced] == [[hashes[0]], [hashes[2]]]
    assert announced[0].parent_block_hash is None

    # One rank's key removed: the block is gone; removing a block never announced says nothing.
    events.on_reports(PoolKeyReports([(REMOVED, 0, digests[1], 0), (REMOVED, 0, "never-stored", 0)]))
    (removed,) = events.take_events()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [hashes[1]]
    events.on_reports(PoolKeyReports([(REMOVED, 0, digests[1], 1)]))
    assert events.take_events() == []  # already said

    events.on_reset()
    assert [type(e) for e in events.take_events()] == [AllBlocksCleared]
    events.on_reports(PoolKeyReports([(REMOVED, 0, digests[0], 0)]))
    assert events.take_events() == []  # the reset forgot what was announced


def test_reports_of_another_engine_or_a_block_not_planned_say_nothing() -> None:
    events, coordinator, request = _scheduler(world_size=1)
    _plan(events, coordinator, request)
    events.on_reports(None)
    events.on_reports(PoolKeyReports([(STORED, 0, "not-planned", 0)]))
    assert events.take_events() == []


def test_events_waiting_for_their_blocks_hold_a_bounded_number_of_token_ids() -> None:
    """Saves that never report (they failed) leave their blocks' events waiting: those events
    hold at most 2**20 token ids all together, however large the blocks (the newest kept)."""
    from kvpool.connector.scheduler.hybrid_hit import HybridHitCoordinator

    block, blocks_per_request, requests = 2048, 20, 30  # 1.2M tokens planned
    groups = [GroupDesc("full", block_size=block)]
    events = SchedulerEvents(make_kv_cache_config(groups), 1)
    coordinator = HybridHitCoordinator.from_vllm_coordinator(make_coordinator(groups, 1 << 17))
    planned: list[str] = []
    for r in range(requests):
        request = hashed_request([r] + [1] * (block * blocks_per_request - 1), block, request_id=f"r{r}")
        ids = list(range(1, blocks_per_request + 1))
        digests = [hash_digest(bytes(h)) for h in request.block_hashes]
        events.track(request)
        save = RequestSave(request.request_id, [GroupTransfer(0, digests, ids)])
        events.on_saves_planned(PoolConnectorMetadata(saves=[save]), lambda _, ids=ids: (ids,), coordinator)
        events.forget(request.request_id)
        planned += digests
    assert len(planned) * block > 1 << 20

    events.on_reports(PoolKeyReports([(STORED, 0, d, 0) for d in planned]))  # now all stored
    announced = events.take_events()
    assert sum(len(e.token_ids) for e in announced) <= 1 << 20
    assert len(announced) == (1 << 20) // block  # the newest, up to the bound
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    assert announced[-1].block_hashes == [maybe_convert_block_hash(request.block_hashes[-1])]
