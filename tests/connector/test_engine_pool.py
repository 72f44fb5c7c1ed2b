"""Two real vLLM CPU engines sharing a prefix through a real Mooncake pool.

Engine A serves P1 and stores its blocks; engine B serves P2, which shares a
288-token prefix with P1. B's output must equal a reference run of P2 without
any connector, B must have taken the prefix from the pool, and a corrupted
pool must change B's output (so the loaded KV is really used).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import pytest

from kvpool.connector.contract.object_header import HEADER_BYTES
from testing.engine import (
    EngineOptions,
    create_llm,
    generate,
    reference_tokens,
    run_engine_subprocess,
    scheduler_connector,
    shutdown_llm,
    transfer_config,
    worker_connector,
    worker_of,
)
from testing.models import build_gemma3, build_gpt_oss
from testing.objects import over_payload
from testing.pool_store import put_bytes, raw_store
from testing.prompts import MAX_TOKENS, P1, P2, PREFIX, PREFIX_HIT, pool_keys

pytestmark = [pytest.mark.engine, pytest.mark.mooncake]


@pytest.fixture(scope="session")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="session")
def gemma_reference(gemma_dir: Path) -> list[int]:
    """P2's output from an engine without any connector (its own process)."""
    return reference_tokens(gemma_dir, [P2], MAX_TOKENS)[0]


def run_in_process(model: Path, config: dict[str, Any], prompts: list[list[int]]) -> tuple[Any, Any]:
    """Run prompts on an in-process engine; return (results, (keyspace, groups, stats))."""
    llm = create_llm(EngineOptions(model=str(model), kv_transfer_config=config))
    try:
        results = generate(llm, prompts, MAX_TOKENS)
        connector = scheduler_connector(llm)
        worker = worker_connector()
        info = (connector.keyspace, len(connector.layout.groups), list(worker.recording.transfers))
        return results, info
    finally:
        shutdown_llm(llm)


def test_engine_b_takes_the_prefix_from_the_pool(gemma_dir, gemma_reference, pool_settings) -> None:
    config = transfer_config(pool_settings)
    run_engine_subprocess(EngineOptions(model=str(gemma_dir), kv_transfer_config=config), [[P1]], MAX_TOKENS)
    b = run_engine_subprocess(
        EngineOptions(model=str(gemma_dir), kv_transfer_config=config, disable_log_stats=False),
        [[P2]],
        MAX_TOKENS,
    )
    assert b.token_ids[0] == gemma_reference
    # A fresh process has no local cache: every cached token came from the pool.
    assert b.results[0].num_cached_tokens == PREFIX_HIT
    assert b.metrics is not None
    assert b.metrics["vllm:external_prefix_cache_hits"] == PREFIX_HIT


def test_corrupted_pool_changes_the_output(gemma_dir, gemma_reference, pool_settings, pool_client) -> None:
    """Negative control: noise in the stored blocks must show in B's output.

    Each object keeps its header (so it passes the check a load makes) and gets noise
    for its K/V bytes.
    """
    from kvpool.connector.contract.object_header import HEADER_BYTES

    config = transfer_config(pool_settings)
    _, (keyspace, num_groups, _) = run_in_process(gemma_dir, config, [P1])
    keys = pool_keys(keyspace, PREFIX, num_groups)
    stored = {key: raw_store(pool_client).get(key) for key in keys}
    assert all(len(data) > HEADER_BYTES for data in stored.values()), "engine A stored every prefix block"
    pool_client.remove(keys)
    for key, data in stored.items():
        assert put_bytes(pool_client, key, over_payload(data, os.urandom(len(data) - HEADER_BYTES))) == 0

    b = run_engine_subprocess(
        EngineOptions(model=str(gemma_dir), kv_transfer_config=config), [[P2]], MAX_TOKENS
    )
    assert b.results[0].num_cached_tokens == PREFIX_HIT
    assert b.token_ids[0] != gemma_reference


def test_window_groups_move_only_their_window(gemma_dir, gemma_reference, pool_settings) -> None:
    config = transfer_config(pool_settings)
    run_in_process(gemma_dir, config, [P1])
    results, (_, _, transfers) = run_in_process(gemma_dir, config, [P2])
    assert results[0].token_ids == gemma_reference
    (load,) = [t for t in transfers if t.operation == "load"]
    kinds = load.group_kinds
    per_block = {k: b // n for k, b, n in zip(kinds, load.bytes, load.blocks) if n}
    for kind, blocks, masked, nbytes in zip(kinds, load.blocks, load.masked, load.bytes):
        if kind == "full":
            assert (blocks, masked) == (9, 0)
        else:
            # A 64-token window at token 288 needs blocks 7 and 8 only.
            assert (blocks, masked) == (2, 7)
        assert nbytes == blocks * per_block[kind]


def corrupt_own_objects(worker: Any, keys: list[str]) -> int:
    """Invert every payload byte of those of ``keys`` that lie in the worker's own segment
    (headers intact: memory gone bad after the write); how many there were."""
    found = [at for at in worker.client.own_objects(keys) if at is not None]
    for address, size in found:
        payload = ctypes.string_at(address + HEADER_BYTES, size - HEADER_BYTES)
        ctypes.memmove(address + HEADER_BYTES, bytes(b ^ 0xFF for b in payload), len(payload))
    return len(found)


def test_an_engine_holding_a_segment_loads_its_hits_directly_and_checks_them(
    gemma_dir, gemma_reference, pool_settings, monkeypatch
) -> None:
    """An engine contributing memory (embedded pools) keeps its saves there. Its local cache
    is dropped before each P2, so the prefix can come only from the pool.

    * Direct loads off, it reads a hit ahead through its staging buffer (here one object a
      batch, so the nine prefix blocks move through both halves).
    * On, the hit is copied straight into the blocks: the output is the reference's.
    * Its objects corrupted in place, the direct writes are caught from the blocks: the
      request recomputes, the output is the reference's, and the next P2 (from vLLM's own
      cache) too: no bad block was kept.
    * Negative control: the blocks' check skipped, the same corruption changes the output.
    """
    from kvpool.connector.worker import side as worker_side
    from kvpool.connector.worker import staging

    halves: list[int] = []
    original = worker_side.load_batches

    def spied(*args: Any) -> tuple[int, int]:
        plan = original(*args)
        halves.append(plan[1])
        return plan

    monkeypatch.setattr(worker_side, "load_batches", spied)
    config = transfer_config(pool_settings, global_segment_size="64MB", load_batch_bytes=1)
    llm = create_llm(EngineOptions(model=str(gemma_dir), kv_transfer_config=config))
    try:
        worker = worker_of()
        keyspace, groups = scheduler_connector(llm).keyspace, len(scheduler_connector(llm).layout.groups)
        p2_keys = pool_keys(keyspace, P2, groups)  # P2's own blocks too, once a P2 saved them

        def p2_from_the_pool() -> tuple[Any, list[Any]]:
            worker.wait_for_saves()
            assert llm.reset_prefix_cache(), "vLLM's own cache dropped"
            seen = len(worker_connector().recording.transfers)
            (result,) = generate(llm, [P2], MAX_TOKENS)
            loads = [t for t in worker_connector().recording.transfers[seen:] if t.operation == "load"]
            return result, loads

        generate(llm, [P1], MAX_TOKENS)
        worker.direct_local_loads = False
        staged, (load,) = p2_from_the_pool()
        assert staged.token_ids == gemma_reference and staged.num_cached_tokens == PREFIX_HIT
        assert 2 in halves, "the full-attention group's nine blocks were read ahead"
        assert (load.direct_blocks, load.failures) == (0, {})

        # The staged P2 saved its own last full block too: the hit is 10 blocks now.
        worker.direct_local_loads = True
        direct, (load,) = p2_from_the_pool()
        assert direct.token_ids == gemma_reference and direct.num_cached_tokens == PREFIX_HIT + 32
        assert {kind: blocks for kind, blocks in zip(load.group_kinds, load.blocks)} == {
            "full": 10,
            "sliding_window": 2,
        }
        assert (load.direct_blocks, load.failures) == (10 + 2 + 2, {})

        worker.wait_for_saves()
        assert corrupt_own_objects(worker, p2_keys) >= 10 + 2 + 2
        caught, loads = p2_from_the_pool()
        assert caught.token_ids == gemma_reference, "recomputed, not served from the bad blocks"
        assert loads[0].recomputed and loads[0].direct_blocks == 10 + 2 + 2
        assert loads[0].failures == {"corrupt": 10 + 2 + 2}, "each block caught from its bytes"
        (cached,) = generate(llm, [P2], MAX_TOKENS)
        assert cached.num_cached_tokens > 0 and cached.token_ids == gemma_reference, "no bad block kept"

        worker.wait_for_saves()
        assert corrupt_own_objects(worker, p2_keys) >= 10 + 2 + 2

        monkeypatch.setattr(staging, "payload_matches", lambda *_: True)  # the blocks' check skipped
        used, (load,) = p2_from_the_pool()
        assert load.direct_blocks and not load.failures
        assert used.token_ids != gemma_reference, "unchecked, the corrupted KV is used"
    finally:
        shutdown_llm(llm)


def test_keys_deleted_between_lookup_and_load(
    gemma_dir, gemma_reference, pool_settings, pool_client, monkeypatch
):
    from kvpool.connector.scheduler import side as scheduler_side

    config = transfer_config(pool_settings)
    _, (keyspace, num_groups, _) = run_in_process(gemma_dir, config, [P1])
    doomed = pool_keys(keyspace, PREFIX, num_groups, blocks=range(4, 9))
    original = scheduler_side.SchedulerSide.update_state_after_alloc

    def delete_then_alloc(self, request, block_ids, num_external):
        pool_client.remove(doomed)
        return original(self, request, block_ids, num_external)

    monkeypatch.setattr(scheduler_side.SchedulerSide, "update_state_after_alloc", delete_then_alloc)
    results, (_, _, transfers) = run_in_process(gemma_dir, config, [P2])
    assert results[0].token_ids == gemma_reference
    first, *retries = [t for t in transfers if t.operation == "load"]
    # The failed load sends the request back; its retry may hit the blocks left.
    # Full attention lost blocks 4..8 of its 9; each window group both of its 2.
    assert num_groups == 3
    assert first.failures == {"missing": 5 + 2 + 2}
    assert all(not r.failures for r in retries)


def test_gpt_oss_layout_shares_prefixes(tmp_path_factory, pool_settings) -> None:
    model = build_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))
    reference = reference_tokens(model, [P2], MAX_TOKENS)[0]
    config = transfer_config(pool_settings)
    run_in_process(model, config, [P1])
    b = run_engine_subprocess(EngineOptions(model=str(model), kv_transfer_config=config), [[P2]], MAX_TOKENS)
    assert b.token_ids[0] == reference
    assert b.results[0].num_cached_tokens == PREFIX_HIT


def test_blocks_that_always_fail_are_recomputed_once(gemma_dir, gemma_reference, pool_settings, pool_client):
    """Objects of the wrong size fail every load: the request recomputes, it never loops."""
    config = transfer_config(pool_settings)
    _, (keyspace, num_groups, _) = run_in_process(gemma_dir, config, [P1])
    keys = pool_keys(keyspace, PREFIX, num_groups)
    pool_client.remove(keys)
    for key in keys:
        assert put_bytes(pool_client, key, b"short") == 0
    results, (_, _, transfers) = run_in_process(gemma_dir, config, [P2])
    assert results[0].token_ids == gemma_reference
    loads = [t for t in transfers if t.operation == "load"]
    assert len(loads) == 1 and sum(loads[0].failures.values()) == 9 + 2 + 2


def test_single_group_model_loads_and_hands_back_failed_blocks(
    tmp_path_factory, pool_settings, pool_client, monkeypatch
):
    """All-full-attention model: one KV group, so a failed load hands back its block ids."""
    from kvpool.connector.scheduler import side as scheduler_side

    model = build_gemma3(
        tmp_path_factory.mktemp("gemma3-full"), layer_types=["full_attention"] * 4, num_hidden_layers=4
    )
    reference = reference_tokens(model, [P2], MAX_TOKENS)[0]
    config = transfer_config(pool_settings)
    run_in_process(model, config, [P1])
    results, (keyspace, num_groups, transfers) = run_in_process(model, config, [P2])
    assert num_groups == 1
    assert results[0].token_ids == reference
    assert results[0].num_cached_tokens == PREFIX_HIT
    (load,) = [t for t in transfers if t.operation == "load"]
    assert load.blocks == (9,) and not load.failures

    # Blocks 4..8 vanish between lookup and load: vLLM gets their ids back and
    # recomputes from block 4 on; the output is still the reference.
    doomed = pool_keys(keyspace, PREFIX, 1, blocks=range(4, 9))
    original = scheduler_side.SchedulerSide.update_state_after_alloc

    def delete_then_alloc(self, request, block_ids, num_external):
        pool_client.remove(doomed)
        return original(self, request, block_ids, num_external)

    monkeypatch.setattr(scheduler_side.SchedulerSide, "update_state_after_alloc", delete_then_alloc)
    results, (_, _, transfers) = run_in_process(model, config, [P2])
    assert results[0].token_ids == reference
    (load,) = [t for t in transfers if t.operation == "load"]
    assert load.failures == {"missing": 5} and load.load_error_blocks == 5
