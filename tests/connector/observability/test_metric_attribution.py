"""Each metric counts what its HELP says, once, where it happened (real Mooncake, real vLLM
scheduler):

* the pool's hit counts only what the pool serves past vLLM's own prefix hit;
* a save's bytes are the bytes that crossed: a block the pool already held moves none (the
  block size the load decision learns still weighs every rank's share, whichever rank held it);
* a save never made (its forward raised) observes no latency and no size;
* a lookup that raises after its answer was taken counts once, as failed;
* a lookup that raised observes no latency.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kvpool.connector.contract import metric_names as m
from kvpool.connector.contract.keys import KeySpace
from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestSave
from kvpool.connector.observability.records import StatsCollector, failed_lookup
from kvpool.connector.observability.vllm_metrics import records_to_data, series_key, transfer_sample
from kvpool.connector.worker.side import WorkerSide
from testing.engine import scheduler_of
from testing.models import build_gemma3
from testing.scheduler import local_pool_transfer, make_request, make_scheduler, matched_tokens
from tests.connector.scheduler.test_scheduler_lookup import FULL_SWA, store_blocks
from tests.connector.worker.test_worker_transfer import (
    GROUP_LAYERS,
    NUM_BLOCKS,
    make_caches,
    two_group_worker,
)

pytestmark = pytest.mark.mooncake

KINDS = tuple(group.kind for group in FULL_SWA)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3(tmp_path_factory.mktemp("gemma3-attribution"))


@pytest.fixture
def scheduler(model_dir, pool_settings):
    scheduler = make_scheduler(model_dir, FULL_SWA, local_pool_transfer(pool_settings))
    yield scheduler
    scheduler.shutdown()


@pytest.fixture
def worker(pool_client, cache_prefix):
    w = two_group_worker(pool_client, cache_prefix)
    w.register_kv_caches(make_caches())
    yield w
    w.shutdown()


def test_the_pools_hit_blocks_start_past_the_local_hit(scheduler, pool_client) -> None:
    """10 blocks in the pool, 4 of them also vLLM's own hit: the pool serves the full group's
    blocks 4..9 (6) and the window's last 2; present are the 6 blocks past the local hit.
    Counted from block 0, the hit was 10 and 2 (and the share of present blocks used, 10/10)."""
    request = make_request(scheduler, list(range(10, 10 + 10 * 32 + 5)))
    store_blocks(pool_client, scheduler, request, {0: range(10), 1: range(10)})
    connector = scheduler.connector
    connector.stats.drain()
    assert matched_tokens(connector, request, 4 * 32) == (6 * 32, True)
    counters = records_to_data(*connector.stats.drain())["counters"]

    def per_group(spec: m.MetricSpec) -> list[float]:
        return [counters.get(series_key(spec, group=g, group_kind=k), 0.0) for g, k in enumerate(KINDS)]

    assert counters[series_key(m.LOOKUP_QUERY_TOKENS)] == 10 * 32 + 5 - 4 * 32
    assert counters[series_key(m.LOOKUP_HIT_TOKENS)] == 6 * 32
    assert per_group(m.GROUP_HIT_TOKENS) == [6 * 32, 6 * 32]
    assert per_group(m.HIT_BLOCKS) == [6, 2]
    assert per_group(m.PRESENT_BLOCKS) == [6, 6]


def test_a_lookup_that_raises_after_its_answer_counts_once_as_failed(scheduler, pool_client) -> None:
    """A lookup answered (a hit of 4 blocks) whose request then raised in the connector is one
    lookup, failed, and grants nothing: not a hit and a failure besides."""
    request = make_request(scheduler, list(range(20, 20 + 5 * 32 + 1)))
    store_blocks(pool_client, scheduler, request, {0: range(5), 1: range(5)})
    connector = scheduler.connector
    side = scheduler_of(connector)

    def broken(*args, **kwargs):
        raise RuntimeError("a load decision bug")

    side._decide = broken
    connector.stats.drain()
    assert matched_tokens(connector, request, 0) == (0, False)
    lookups, _ = connector.stats.drain()
    assert [dict(r.failures) for r in lookups] == [{"other_error": 1}]
    assert lookups[0].hit_tokens == 0 and lookups[0].query_tokens == 5 * 32 + 1


def test_a_lookup_that_raised_observes_no_latency() -> None:
    """A lookup that raised was never timed: it counts as a lookup, failed, and adds no 0 s
    lookup to the latency histogram."""
    data = records_to_data([failed_lookup(KINDS, SimpleNamespace(num_tokens=100), 32)], [])
    all_groups = {"group": "all", "group_kind": "all"}
    assert data["counters"][series_key(m.LOOKUPS)] == 1
    assert data["counters"][series_key(m.LOOKUP_QUERY_TOKENS)] == 68
    assert (
        data["counters"][series_key(m.FAILURES, operation="lookup", reason="other_error", **all_groups)] == 1
    )
    assert data["histograms"] == {}


def _save_one(worker, req_id: str, block: int) -> None:
    save = RequestSave(req_id, [GroupTransfer(0, ["a"], [block]), GroupTransfer(1, [], [])])
    worker.start_saves(PoolConnectorMetadata(saves=[save]))
    worker.before_forward()
    worker.wait_for_saves()


def test_a_save_of_a_block_the_pool_holds_moves_no_bytes(worker) -> None:
    """The second save of key "a" finds it published (Mooncake keeps the first value): the
    block is stored, no byte crossed, and the block-size estimate the load decision uses
    stays the size of one block."""
    _save_one(worker, "first", 1)
    _save_one(worker, "again", 2)
    first, again = worker.stats.drain()[1]
    assert first.blocks == (1, 0) and first.bytes == (worker.group_block_bytes(0), 0)
    assert again.blocks == (1, 0) and again.bytes == (0, 0) and not again.failures
    data = records_to_data([], [again])
    save = {"group": 0, "group_kind": "full", "operation": "save"}
    assert data["counters"].get(series_key(m.TRANSFER_BYTES, **save), 0.0) == 0.0
    assert data["histograms"][series_key(m.TRANSFER_SIZE_BYTES, operation="save")] == [0.0]
    sample = transfer_sample(records_to_data([], [first, again]))
    assert sample.group_bytes[0] / sample.group_blocks[0] == worker.group_block_bytes(0)


def test_a_block_one_rank_held_weighs_every_ranks_share(pool_client, cache_prefix) -> None:
    """Tensor parallel over 2 ranks: rank 1's key of block "a" is in the pool already (its
    store kept it, rank 0's was lost), so rank 0 writes its share and rank 1 finds its own
    held. The block is stored on both: the block size the load decision learns is both
    shares, as for a block both ranks wrote."""
    ranks = [
        WorkerSide(
            client=pool_client,
            keyspace=KeySpace(cache_prefix, "fp"),
            tp_rank=rank,
            tp_size=2,
            pp_rank=0,
            group_layers=GROUP_LAYERS,
            num_blocks=NUM_BLOCKS,
            stats=StatsCollector(group_kinds=KINDS, rank=rank),
        )
        for rank in (0, 1)
    ]
    try:
        for w in ranks:
            w.register_kv_caches(make_caches())
        _save_one(ranks[1], "earlier", 1)  # rank 1's key of "a" only
        ranks[1].stats.drain()
        for w in ranks:
            _save_one(w, "both", 2)
        (wrote,), (held,) = (w.stats.drain()[1] for w in ranks)
        assert wrote.bytes[0] == ranks[0].group_block_bytes(0) and held.bytes[0] == 0
        sample = transfer_sample(records_to_data([], [wrote, held]))
        assert sample.group_bytes[0] / sample.group_blocks[0] == 2 * ranks[0].group_block_bytes(0)
    finally:
        for w in ranks:
            w.shutdown()


def test_a_save_its_forward_dropped_observes_no_latency(worker) -> None:
    """A save not made (the step's forward raised) counts its keys failed and nothing else:
    no 0 s save in the latency histogram, no 0-byte save in the size histogram."""
    save = RequestSave("r", [GroupTransfer(0, ["d0", "d1"], [1, 2]), GroupTransfer(1, ["d2"], [3])])
    worker.drop_saves(PoolConnectorMetadata(saves=[save]))
    data = records_to_data(*worker.stats.drain())
    failed = {"operation": "save", "reason": "forward_failed"}
    assert data["counters"][series_key(m.FAILURES, group=0, group_kind="full", **failed)] == 2
    assert data["counters"][series_key(m.FAILURES, group=1, group_kind="sliding_window", **failed)] == 1
    assert data["histograms"] == {}
