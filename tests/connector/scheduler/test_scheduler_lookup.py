"""The real vLLM Scheduler with KVPoolConnector against a real Mooncake master.

Blocks are written into the pool by a real store client under the keys a
worker would use; the scheduler must then grant exactly the external tokens
the hybrid hit allows and plan loads of exactly the masked blocks.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from vllm.v1.request import RequestStatus

from kvpool.connector.contract.keys import hash_digest
from kvpool.connector.metadata import PoolConnectorMetadata
from testing.engine import scheduler_of
from testing.kv_cache import GroupDesc
from testing.models import build_gemma3
from testing.pool_store import put_bytes
from testing.scheduler import (
    PresenceMeter,
    admit,
    local_pool_transfer,
    make_request,
    make_scheduler,
    matched_tokens,
    schedule_answered,
    settle,
)

pytestmark = pytest.mark.mooncake

FULL_SWA = [GroupDesc("full", 32), GroupDesc("sliding_window", 32, window=64)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3(tmp_path_factory.mktemp("gemma3"))


def store_blocks(client, scheduler, request, blocks_per_group: dict[int, range]) -> None:
    """Write the blocks a worker would have saved for ``request``."""
    connector = scheduler.connector
    coord = scheduler_of(connector).coordinator
    for group_id, indices in blocks_per_group.items():
        view = coord.group_block_hashes(group_id, request.block_hashes)
        for i in indices:
            key = connector.keyspace.key(group_id, 0, 0, hash_digest(bytes(view[i])))
            assert put_bytes(client, key, b"kv" * 8) == 0


def admitted_from_pool(scheduler, client, prompt: list[int], blocks_per_group: dict[int, range]):
    """``prompt`` admitted with ``blocks_per_group`` in the pool: (request, step output, its load)."""
    request = make_request(scheduler, prompt)
    store_blocks(client, scheduler, request, blocks_per_group)
    scheduler.add_request(request)
    output = admit(scheduler)
    load = _load_of(output, request.request_id)
    assert load is not None
    return request, output, load


def _load_of(output, req_id: str):
    meta = output.kv_connector_metadata
    assert isinstance(meta, PoolConnectorMetadata)
    loads = [load for load in meta.loads if load.req_id == req_id]
    return loads[0] if loads else None


def test_hybrid_hit_loads_window_only(model_dir, pool_settings, pool_client) -> None:
    scheduler = make_scheduler(model_dir, FULL_SWA, local_pool_transfer(pool_settings))
    try:
        first = make_request(scheduler, list(range(10, 10 + 10 * 32 + 5)))
        store_blocks(pool_client, scheduler, first, {0: range(10), 1: range(10)})

        # Shares 8 whole blocks with `first`, then differs.
        second = make_request(scheduler, list(range(10, 10 + 8 * 32)) + [7] * 100)
        scheduler.add_request(second)
        # Its lookup is in flight: vLLM skips it this step.
        first_step = schedule_answered(scheduler)
        assert second.status == RequestStatus.WAITING and not first_step.num_scheduled_tokens
        output = scheduler.schedule()

        # Hybrid layouts load asynchronously: the request waits for its KV.
        assert second.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert second.num_computed_tokens == 8 * 32
        load = _load_of(output, second.request_id)
        assert load is not None and load.hit_tokens == 8 * 32
        full, window = load.groups
        assert len(full.block_ids) == 8 and full.masked == 0
        # A 64-token window needs the last two blocks; six are masked out.
        assert len(window.block_ids) == 2 and window.masked == 6
        coord = scheduler_of(scheduler.connector).coordinator
        assert window.digests == [
            hash_digest(bytes(h)) for h in coord.group_block_hashes(1, second.block_hashes)[6:8]
        ]
        blocks = scheduler.kv_cache_manager.get_block_ids(second.request_id)
        assert full.block_ids == blocks[0][:8]
        assert window.block_ids == blocks[1][6:8]
    finally:
        scheduler.shutdown()


def test_window_group_missing_blocks_cuts_the_hit(model_dir, pool_settings, pool_client) -> None:
    scheduler = make_scheduler(model_dir, FULL_SWA, local_pool_transfer(pool_settings))
    try:
        # Full attention holds 11 blocks; the window group lost blocks 5..10.
        prompt = list(range(3, 3 + 12 * 32))
        request, _, load = admitted_from_pool(scheduler, pool_client, prompt, {0: range(11), 1: range(5)})
        assert request.num_computed_tokens == 5 * 32
        blocks = scheduler.kv_cache_manager.get_block_ids(request.request_id)
        assert load.groups[0].block_ids == blocks[0][:5]
        assert load.groups[1].block_ids == blocks[1][3:5]
    finally:
        scheduler.shutdown()


def test_single_group_loads_asynchronously_and_nothing_is_cached_before_it_lands(
    model_dir, pool_settings, pool_client
) -> None:
    """Every load is asynchronous: until the workers report it, vLLM caches none of its blocks,
    so a request with the same prefix cannot take them as a local hit (a failed load's
    blocks hold whatever was there before)."""
    scheduler = make_scheduler(model_dir, [GroupDesc("full", 32)], local_pool_transfer(pool_settings))
    try:
        prompt = list(range(1, 1 + 6 * 32 + 3))
        request = make_request(scheduler, prompt)
        store_blocks(pool_client, scheduler, request, {0: range(4)})
        scheduler.add_request(request)
        output = admit(scheduler)
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert request.num_computed_tokens == 4 * 32
        assert request.request_id not in output.num_scheduled_tokens
        load = _load_of(output, request.request_id)
        assert load is not None and len(load.groups[0].block_ids) == 4
        assert not output.has_sync_kv_loads
        sharer = make_request(scheduler, prompt)
        _, local_hit, _ = scheduler.kv_cache_manager.get_computed_blocks(sharer)
        assert local_hit == 0, "blocks of a load in flight are no local prefix hit"
    finally:
        scheduler.shutdown()


def test_miss_when_pool_is_empty(model_dir, pool_settings) -> None:
    scheduler = make_scheduler(model_dir, FULL_SWA, local_pool_transfer(pool_settings))
    try:
        request = make_request(scheduler, list(range(5, 5 + 4 * 32)))
        scheduler.add_request(request)
        output = admit(scheduler)
        assert output.num_scheduled_tokens[request.request_id] == 4 * 32
        assert _load_of(output, request.request_id) is None
        # Every computed block is planned for saving, per group.
        meta = output.kv_connector_metadata
        (save,) = [s for s in meta.saves if s.req_id == request.request_id]
        assert [len(g.block_ids) for g in save.groups] == [4, 4]
    finally:
        scheduler.shutdown()


def test_producer_role_never_loads(model_dir, pool_settings, pool_client) -> None:
    scheduler = make_scheduler(model_dir, FULL_SWA, local_pool_transfer(pool_settings, "kv_producer"))
    try:
        request = make_request(scheduler, list(range(10, 10 + 6 * 32)))
        store_blocks(pool_client, scheduler, request, {0: range(6), 1: range(6)})
        scheduler.add_request(request)
        output = scheduler.schedule()  # no lookup to wait for: admitted at once
        assert output.num_scheduled_tokens[request.request_id] == 6 * 32
        assert _load_of(output, request.request_id) is None
    finally:
        scheduler.shutdown()


def test_consumer_role_never_saves(model_dir, pool_settings) -> None:
    scheduler = make_scheduler(model_dir, FULL_SWA, local_pool_transfer(pool_settings, "kv_consumer"))
    try:
        request = make_request(scheduler, list(range(10, 10 + 6 * 32)))
        scheduler.add_request(request)
        output = admit(scheduler)
        assert output.kv_connector_metadata.saves == []
    finally:
        scheduler.shutdown()


def _master_counter(local_pool, name: str) -> float:
    for line in local_pool.master.metrics().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported by the master")


def test_one_round_trip_per_lookup(model_dir, pool_settings, local_pool) -> None:
    """A miss in one batch_is_exist: the blocks the fixed point reads first (full attention's
    whole prefix, and the window at its end) and, being few more (``ASK_AHEAD_KEYS``), every
    other window block, so neither a shorter hit nor the statistics need another."""
    scheduler = make_scheduler(model_dir, FULL_SWA, local_pool_transfer(pool_settings))
    try:
        calls = _master_counter(local_pool, "master_batch_exist_key_requests_total")
        items = _master_counter(local_pool, "master_batch_exist_key_items_total")
        request = make_request(scheduler, list(range(9, 9 + 40 * 32 + 1)))
        scheduler.add_request(request)
        admit(scheduler)
        # 40 full-attention blocks; a 64-token window needs its last 2 blocks, and 38 more are asked.
        assert scheduler.connector.stats.lookups[-1].keys == 40 + 2 + 38
        # The statistics have nothing left to ask.
        assert settle(scheduler.connector, 5.0)
        assert _master_counter(local_pool, "master_batch_exist_key_requests_total") - calls == 1
        assert _master_counter(local_pool, "master_batch_exist_key_items_total") - items == 2 * 40
        (record,) = scheduler.connector.stats.lookups
        assert tuple(record.present_blocks) == (0, 0) and tuple(record.group_hit_tokens) == (0, 0)
    finally:
        scheduler.shutdown()


def test_a_load_other_than_the_planned_one_is_refused_and_recomputed(
    model_dir, pool_settings, pool_client, monkeypatch
) -> None:
    """vLLM allocates for a number of external tokens the lookup did not plan (here one block
    more): the connector loads nothing rather than load a plan that is not what vLLM counts as
    computed, and the request recomputes; the engine core never raises."""
    from kvpool.connector.connector import KVPoolConnector

    scheduler = make_scheduler(model_dir, [GroupDesc("full", 32)], local_pool_transfer(pool_settings))
    try:
        request = make_request(scheduler, list(range(1, 1 + 6 * 32 + 3)))
        store_blocks(pool_client, scheduler, request, {0: range(4)})
        answer = KVPoolConnector.get_num_new_matched_tokens

        def one_block_more(self, req, num_computed):
            tokens, load_async = answer(self, req, num_computed)
            return (tokens if not tokens else tokens + 32), load_async

        monkeypatch.setattr(KVPoolConnector, "get_num_new_matched_tokens", one_block_more)
        scheduler.add_request(request)
        output = admit(scheduler)
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        load = _load_of(output, request.request_id)
        assert load is not None and load.refused and not load.groups
        monkeypatch.undo()
        # What every worker then reports (``WorkerSide`` reports a refused load failed).
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        failed = KVConnectorOutput(finished_recving={request.request_id}, failed_recving={request.request_id})
        scheduler.update_from_output(
            output, ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=failed)
        )
        rerun = scheduler.schedule()
        assert rerun.num_scheduled_tokens.get(request.request_id) == len(request.prompt_token_ids)
        assert _load_of(rerun, request.request_id) is None, "the request never takes the pool's word again"
    finally:
        scheduler.shutdown()


def test_a_lookup_answer_older_than_the_lookup_deadline_is_asked_again(
    model_dir, pool_settings, pool_client
) -> None:
    """A request vLLM could not allocate for a while keeps its lookup answer, but not past
    ``lookup_timeout_s``: the blocks may have left the pool meanwhile."""
    scheduler = make_scheduler(
        model_dir, [GroupDesc("full", 32)], local_pool_transfer(pool_settings, lookup_timeout_s=0.5)
    )
    try:
        request = make_request(scheduler, list(range(1, 1 + 6 * 32 + 3)))
        store_blocks(pool_client, scheduler, request, {0: range(4)})
        connector = scheduler.connector
        assert matched_tokens(connector, request) == (4 * 32, True)
        # The blocks leave the pool (evicted) while vLLM has not allocated the request yet.
        coord = scheduler_of(connector).coordinator
        view = coord.group_block_hashes(0, request.block_hashes)
        keys = [connector.keyspace.key(0, 0, 0, hash_digest(bytes(view[i]))) for i in range(4)]
        assert pool_client.remove(keys) == [0] * 4
        assert connector.get_num_new_matched_tokens(request, 0) == (4 * 32, True), "fresh: kept"
        time.sleep(0.6)
        assert matched_tokens(connector, request) == (0, False), "stale: asked again, a miss"
    finally:
        scheduler.shutdown()


@pytest.mark.parametrize("retained", [0, 33])
def test_a_window_group_loads_every_block_vllm_keeps_below_its_window(
    model_dir, pool_settings, pool_client, retained
) -> None:
    """Multi-module MTP makes vLLM keep ``extra_retained_tokens`` below a sliding window: it
    allocates real blocks for them and caches them once the load is reported. Every one of
    them is loaded (33 tokens keep one more 32-token block), none is left holding garbage."""
    groups = [GroupDesc("full", 32), GroupDesc("sliding_window", 32, window=64, retained=retained)]
    scheduler = make_scheduler(model_dir, groups, local_pool_transfer(pool_settings))
    try:
        prompt = list(range(3, 3 + 8 * 32 + 5))
        request, _, load = admitted_from_pool(scheduler, pool_client, prompt, {0: range(8), 1: range(8)})
        assert request.num_computed_tokens == 8 * 32
        window_blocks = scheduler.kv_cache_manager.get_block_ids(request.request_id)[1][:8]
        kept = [block for block in window_blocks if block > 0]
        assert len(kept) == (3 if retained else 2)
        assert load.groups[1].block_ids == kept
        assert load.groups[1].masked == 8 - len(kept)
        view = scheduler_of(scheduler.connector).coordinator.group_block_hashes(1, request.block_hashes)
        assert load.groups[1].digests == [hash_digest(bytes(view[i])) for i in range(8 - len(kept), 8)]
    finally:
        scheduler.shutdown()


@pytest.mark.parametrize("retained", [0, 33])
def test_a_window_group_saves_every_block_a_hit_loads_below_its_window(
    model_dir, pool_settings, pool_client, retained
) -> None:
    """A window group saves only the blocks a hit can reach (vLLM's reachable mask, sparse when
    the full-attention block is larger). With multi-module MTP a hit also loads the blocks vLLM
    keeps below the window, so those are saved too: what one engine saves, another loads whole."""
    groups = [GroupDesc("full", 128), GroupDesc("sliding_window", 32, window=32, retained=retained)]
    prompt = list(range(5, 5 + 4 * 128 + 5))
    saving = make_scheduler(model_dir, groups, local_pool_transfer(pool_settings))
    try:
        request = make_request(saving, prompt)
        saving.add_request(request)
        meta = admit(saving).kv_connector_metadata  # a miss: the whole prompt in this step
        assert isinstance(meta, PoolConnectorMetadata)
        (save,) = [s for s in meta.saves if s.req_id == request.request_id]
        assert save.groups[1].masked > 0, "the window group's mask is sparse"
        keyspace = saving.connector.keyspace
        saved = set()
        for group in save.groups:  # written as a worker would
            for digest in group.digests:
                assert put_bytes(pool_client, keyspace.key(group.group_id, 0, 0, digest), b"kv" * 8) == 0
                saved.add((group.group_id, digest))
    finally:
        saving.shutdown()
    loading = make_scheduler(model_dir, groups, local_pool_transfer(pool_settings))
    try:
        again = make_request(loading, prompt)
        loading.add_request(again)
        load = _load_of(admit(loading), again.request_id)
        assert load is not None and load.hit_tokens == 4 * 128
        loaded = {(group.group_id, digest) for group in load.groups for digest in group.digests}
        assert len(load.groups[1].digests) == (2 if retained else 1)
        assert loaded <= saved, "a hit loads a block nobody saved: its load fails"
    finally:
        loading.shutdown()


def test_a_request_no_hit_could_serve_is_admitted_without_waiting_for_a_lookup(
    model_dir, pool_settings, pool_client
) -> None:
    """A prompt shorter than a block, and one whose local hit already covers every block a hit
    could, have nothing to ask the pool: they are scheduled in their first step (an
    asynchronous lookup would cost them a whole step), never deferred, never looked up."""
    scheduler = make_scheduler(model_dir, [GroupDesc("full", 32)], local_pool_transfer(pool_settings))
    try:
        connector = scheduler.connector
        meter = PresenceMeter(connector)
        deferred: list[str] = []
        matched = connector.get_num_new_matched_tokens

        def counted(request, num_computed_tokens):
            got = matched(request, num_computed_tokens)
            if got[0] is None:
                deferred.append(request.request_id)
            return got

        connector.get_num_new_matched_tokens = counted
        short = make_request(scheduler, list(range(3, 3 + 20)))
        scheduler.add_request(short)
        first = scheduler.schedule()
        assert first.num_scheduled_tokens.get(short.request_id) == 20
        assert (deferred, meter.checks, connector.stats.lookups) == ([], 0, [])
        # A local hit of the prompt's two whole blocks (a hit never covers the last token).
        prompt = list(range(40, 40 + 2 * 32 + 1))
        warm = make_request(scheduler, prompt)
        scheduler.add_request(warm)
        admit(scheduler)
        assert deferred == [warm.request_id], "a request a hit could serve is looked up"
        checks, lookups = meter.checks, len(connector.stats.lookups)
        again = make_request(scheduler, prompt)
        scheduler.add_request(again)
        step = scheduler.schedule()
        assert step.num_scheduled_tokens.get(again.request_id) == 1, "scheduled at once, past its local hit"
        (new,) = [r for r in step.scheduled_new_reqs if r.req_id == again.request_id]
        assert new.num_computed_tokens == 2 * 32, "its local hit"
        assert deferred == [warm.request_id] and meter.checks == checks
        assert len(connector.stats.lookups) == lookups
    finally:
        scheduler.shutdown()


@pytest.mark.parametrize("algorithm", ["xxhash", "xxhash_cbor"])
def test_a_block_hash_that_is_not_collision_resistant_joins_only_when_allowed(
    model_dir, pool_settings, algorithm
) -> None:
    """A crafted prompt colliding with another's block hash would place its KV under that
    prompt's key for every engine: an engine hashing with xxhash does not start, and says
    which setting accepts the risk."""
    from testing.kv_cache import make_kv_cache_config
    from testing.scheduler import engine_config, scheduler_over

    groups = [GroupDesc("full", 32)]
    for allowed in (False, True):
        transfer = local_pool_transfer(pool_settings, allow_non_cryptographic_block_hash=allowed)
        vllm_config = engine_config(model_dir, transfer)
        vllm_config.cache_config.prefix_caching_hash_algo = algorithm
        if not allowed:
            with pytest.raises(ValueError, match="allow_non_cryptographic_block_hash") as refused:
                scheduler_over(vllm_config, make_kv_cache_config(groups), 32, 32)
            assert algorithm in str(refused.value)
            continue
        scheduler = scheduler_over(vllm_config, make_kv_cache_config(groups), 32, 32)
        try:
            assert scheduler.connector is not None
        finally:
            scheduler.shutdown()


def test_a_lookup_that_raises_is_a_miss_counted_failed(model_dir, pool_settings, monkeypatch) -> None:
    """A bug in a lookup never stops a request (it computes), and is counted: a lookup failed
    as ``other_error``, which the lookup failure alert sees."""
    scheduler = make_scheduler(model_dir, [GroupDesc("full", 32)], local_pool_transfer(pool_settings))
    try:
        connector = scheduler.connector
        side = scheduler_of(connector)

        def broken(request, num_computed_tokens):
            raise RuntimeError("a lookup bug")

        monkeypatch.setattr(side, "get_num_new_matched_tokens", broken)
        request = make_request(scheduler, list(range(1, 1 + 3 * 32 + 1)))
        connector.stats.drain()
        assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
        lookups, _ = connector.stats.drain()
        assert [dict(r.failures) for r in lookups] == [{"other_error": 1}]
        assert lookups[0].query_tokens == 3 * 32 + 1 and lookups[0].hit_tokens == 0
    finally:
        scheduler.shutdown()
