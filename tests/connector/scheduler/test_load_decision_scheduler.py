"""The load decision on vLLM's real scheduler, against a real Mooncake master.

A pool hit the decision recomputes is scheduled exactly as a miss: all its tokens computed
in its admitting step, no load planned, nothing waiting for remote KV, and only the blocks
past the pool's hit planned to save. The same hit loads
when loading is the faster. ``load_policy: never`` asks the pool nothing: no request waits
a step for a lookup.

No worker runs here, so the rates are fed as a worker and the engine's steps would feed
them: the load rate through ``on_step_output`` with a worker stats payload built from a
``TransferRecord`` (the real channel), the prefill rate as observations (this test says
so: a scheduler without a model has no steps to time).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.v1.request import RequestStatus

from kvpool.connector.contract import metric_names as m
from kvpool.connector.contract.keys import hash_digest
from kvpool.connector.metadata import PoolConnectorMetadata
from kvpool.connector.observability.records import TransferRecord
from kvpool.connector.observability.vllm_metrics import PoolConnectorStats, records_to_data, series_key
from testing.engine import scheduler_of
from testing.kv_cache import GroupDesc
from testing.models import build_gemma3
from testing.pool_store import put_bytes
from testing.scheduler import PresenceMeter, admit, local_pool_transfer, make_request, make_scheduler

pytestmark = pytest.mark.mooncake

MIB = 1 << 20
BLOCKS = 4  # the pool holds the prompt's first four 32-token blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3(tmp_path_factory.mktemp("gemma3"))


def feed_rates(scheduler, *, load_bytes_per_s: float, prefill_tokens_per_s: float) -> None:
    """One worker load of 1 MiB per block at ``load_bytes_per_s``, and prefill at ``prefill_tokens_per_s``."""
    side = scheduler_of(scheduler.connector)
    seconds = BLOCKS * MIB / load_bytes_per_s
    load = TransferRecord(
        operation=m.LOAD,
        group_kinds=("full",),
        blocks=(BLOCKS,),
        masked=(0,),
        bytes=(BLOCKS * MIB,),
        failures={},
        seconds=seconds,
        group_failures=({},),
        group_seconds=(seconds,),
        group_attempted=(True,),
        rank=0,
    )
    side.on_step_output(PoolConnectorStats(data=records_to_data([], [load])))
    side.rates.prefill.observe(prefill_tokens_per_s, 1.0)


def pooled_request(scheduler, client, prompt: list[int]):
    """A request for ``prompt`` whose first ``BLOCKS`` blocks the pool holds."""
    request = make_request(scheduler, prompt)
    connector = scheduler.connector
    for index in range(BLOCKS):
        key = connector.keyspace.key(0, 0, 0, hash_digest(bytes(request.block_hashes[index])))
        assert put_bytes(client, key, b"kv" * 8) == 0
    return request


def loads_of(output) -> list:
    meta = output.kv_connector_metadata
    assert isinstance(meta, PoolConnectorMetadata)
    return meta.loads


def counters(scheduler) -> dict[str, float]:
    stats = scheduler.connector.get_kv_connector_stats()
    return {} if stats is None else stats.data["counters"]


def test_a_hit_cheaper_to_recompute_is_scheduled_as_a_miss(model_dir, pool_settings, pool_client) -> None:
    transfer = local_pool_transfer(pool_settings, load_decision_min_samples=1)
    scheduler = make_scheduler(model_dir, [GroupDesc("full", 32)], transfer)
    try:
        # 4 MiB at 1 MiB/s: 4 s to load; 128 tokens at 1000 tokens/s: 0.128 s to recompute.
        feed_rates(scheduler, load_bytes_per_s=MIB, prefill_tokens_per_s=1000)
        prompt = list(range(5, 5 + 6 * 32 + 3))
        request = pooled_request(scheduler, pool_client, prompt)
        scheduler.add_request(request)
        output = admit(scheduler)
        assert loads_of(output) == []
        assert request.status == RequestStatus.RUNNING
        assert output.num_scheduled_tokens[request.request_id] == len(prompt), "computed whole, as a miss"
        (new,) = output.scheduled_new_reqs
        assert new.num_computed_tokens == 0
        side = scheduler_of(scheduler.connector)
        assert side.requests[request.request_id].loaded_blocks is None
        got = counters(scheduler)
        assert got[series_key(m.LOAD_DECISIONS, decision="recompute", basis="estimate")] == 1
        assert got[series_key(m.LOAD_SKIPPED_TOKENS)] == BLOCKS * 32
        assert got[series_key(m.LOOKUP_HIT_TOKENS)] == BLOCKS * 32, "the pool held it"
        # Its save plans only the blocks past the pool's hit: the pool holds the others,
        # and saving them again would read them out of vLLM's blocks for nothing.
        (save,) = output.kv_connector_metadata.saves
        past_the_hit = request.block_hashes[BLOCKS : len(prompt) // 32]
        assert save.groups[0].digests == [hash_digest(bytes(h)) for h in past_the_hit]
    finally:
        scheduler.shutdown()


def test_the_same_hit_loads_when_loading_is_faster(model_dir, pool_settings, pool_client) -> None:
    transfer = local_pool_transfer(pool_settings, load_decision_min_samples=1)
    scheduler = make_scheduler(model_dir, [GroupDesc("full", 32)], transfer)
    try:
        # 4 MiB at 1 GiB/s: 4 ms to load; 128 tokens at 1000 tokens/s: 0.128 s to recompute.
        feed_rates(scheduler, load_bytes_per_s=1024 * MIB, prefill_tokens_per_s=1000)
        request = pooled_request(scheduler, pool_client, list(range(5, 5 + 6 * 32 + 3)))
        scheduler.add_request(request)
        output = admit(scheduler)
        (load,) = loads_of(output)
        assert len(load.groups[0].block_ids) == BLOCKS
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert request.num_computed_tokens == BLOCKS * 32
        got = counters(scheduler)
        assert got[series_key(m.LOAD_DECISIONS, decision="load", basis="estimate")] == 1
        assert got.get(series_key(m.LOAD_SKIPPED_TOKENS)) in (None, 0.0), "nothing recomputed"
        gauges = scheduler.connector.get_kv_connector_stats()
        assert gauges is None, "rates unchanged since the last export: nothing new"
    finally:
        scheduler.shutdown()


def test_below_the_floor_the_hit_loads(model_dir, pool_settings, pool_client) -> None:
    """Rates that would recompute it, on fewer observations than the floor (4 by default)."""
    scheduler = make_scheduler(model_dir, [GroupDesc("full", 32)], local_pool_transfer(pool_settings))
    try:
        feed_rates(scheduler, load_bytes_per_s=MIB, prefill_tokens_per_s=1000)
        request = pooled_request(scheduler, pool_client, list(range(5, 5 + 6 * 32 + 3)))
        scheduler.add_request(request)
        (load,) = loads_of(admit(scheduler))
        assert load.req_id == request.request_id
        assert counters(scheduler)[series_key(m.LOAD_DECISIONS, decision="load", basis="floor")] == 1
    finally:
        scheduler.shutdown()


def test_load_policy_never_asks_nothing_and_defers_nothing(model_dir, pool_settings, pool_client) -> None:
    transfer = local_pool_transfer(pool_settings, load_policy="never")
    scheduler = make_scheduler(model_dir, [GroupDesc("full", 32)], transfer)
    try:
        meter = PresenceMeter(scheduler.connector)
        prompt = list(range(5, 5 + 6 * 32 + 3))
        request = pooled_request(scheduler, pool_client, prompt)
        scheduler.add_request(request)
        output = scheduler.schedule()
        assert output.num_scheduled_tokens[request.request_id] == len(prompt), "in its first step"
        assert loads_of(output) == []
        assert meter.checks == 0
        assert scheduler.connector.stats.lookups == []
    finally:
        scheduler.shutdown()
