"""Replicated KV on real engines: ranks that hold copies of one KV head store it once.

The model has one KV head (and four query heads), so at TP=2 vLLM gives both ranks a copy
of it: one KV shard. Engine A (TP=2) serves a 700-token prompt and a second one; the pool
then holds one object per block (shard 0's, written by rank 0), none of rank 1's, and A's
saves moved one rank's bytes. Every K/V byte of the second prompt's objects is replaced
by noise in a well-formed object (its header, stating the noise's CRC): the negative control.

A fresh TP=2 engine B, then a TP=1 engine C (same shard split, so the same keys), serve
prompts sharing the first 100, 333, 650 and 700 tokens of the first prompt, one after
another, the local prefix cache emptied after each, then one sharing the noisy prompt's
prefix. Both hit the pool and produce what a TP=1 engine without any connector produces,
except for the negative control; both of B's ranks read the one object (their bytes
count twice).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvpool.connector.contract.keys import hash_digest
from kvpool.connector.contract.object_header import HEADER_BYTES
from kvpool.connector.contract.settings import ConnectorSettings
from testing.engine import (
    PATIENT_DEADLINES,
    EngineOptions,
    EngineReport,
    run_engine_subprocess,
    transfer_config,
)
from testing.models import build_gemma3_one_kv_head
from testing.objects import over_payload
from testing.pool_store import put_bytes, raw_store
from testing.prompts import BLOCK, block_hashes
from tests.connector.test_tensor_parallel import (
    FOLLOWERS,
    LONG,
    MAX_TOKENS,
    NOISY,
    NOISY_FOLLOWER,
    NOISY_HIT,
    SHARED,
    TP_ENV,
    connector_warnings,
    logged_keyspace,
    rank_block_bytes,
)

pytestmark = [pytest.mark.engine, pytest.mark.mooncake]

#: Whole blocks of each shared prefix (A stored all 21 of the long prompt).
EXPECTED_HITS = [n // BLOCK * BLOCK for n in SHARED]


def options(model: Path, config: dict[str, Any] | None, tp: int) -> EngineOptions:
    kwargs: dict[str, Any] = {"tensor_parallel_size": tp}
    if tp > 1:
        kwargs["distributed_executor_backend"] = "mp"
    return EngineOptions(
        model=str(model),
        kv_transfer_config=config,
        dtype="float32",
        llm_kwargs=kwargs,
        disable_log_stats=False,
    )


def run(
    model: Path, config: dict[str, Any] | None, tp: int, batches: list[list[list[int]]], **kw: Any
) -> EngineReport:
    return run_engine_subprocess(
        options(model, config, tp), batches, MAX_TOKENS, env=TP_ENV if tp > 1 else None, **kw
    )


def counter(report: EngineReport, name: str, **labels: Any) -> float:
    assert report.metrics is not None
    label_text = ",".join(f"{k}={v}" for k, v in labels.items())
    return report.metrics.get(f"vllm:kvpool_{name}{{{label_text}}}", 0.0)


B_BATCHES = [[p] for p in [*FOLLOWERS, NOISY_FOLLOWER]]
FULL = {"group": 0, "group_kind": "full"}


def test_one_object_per_shard_read_by_every_rank_and_by_another_tp_size(
    pool_settings: ConnectorSettings, pool_client: Any, tmp_path: Path
) -> None:
    model = build_gemma3_one_kv_head(tmp_path / "model")
    reference = run(model, None, 1, B_BATCHES).token_ids
    config = transfer_config(pool_settings, **PATIENT_DEADLINES)

    a = run(model, config, 2, [[LONG], [NOISY]], log_path=tmp_path / "a.log")
    keyspace, kinds = logged_keyspace(tmp_path / "a.log", pool_settings.cache_prefix)
    assert kinds == ["full"]
    page = rank_block_bytes(tmp_path / "a.log")[0]
    # One object per block of both prompts: shard 0's; rank 1 holds a copy and stored nothing.
    for prompt in (LONG, NOISY):
        digests = [hash_digest(h) for h in block_hashes(prompt)[: len(prompt) // BLOCK]]
        assert pool_client.exists([keyspace.key(0, 0, 0, d) for d in digests]) == [True] * len(digests)
        assert pool_client.exists([keyspace.key(0, 1, 0, d) for d in digests]) == [False] * len(digests)
        assert {pool_client.size_of(keyspace.key(0, 0, 0, d)) for d in digests} == {HEADER_BYTES + page}
    # The saves A reported (those done before its last step) moved one rank's bytes per block.
    saved = counter(a, "transfer_blocks", **FULL, operation="save")
    assert saved > 0
    assert counter(a, "transfer_bytes", **FULL, operation="save") == saved * page

    # Negative control: noise in every K/V byte of the second prompt's shared blocks.
    for digest in [hash_digest(h) for h in block_hashes(NOISY)[: NOISY_HIT // BLOCK]]:
        noisy_key = keyspace.key(0, 0, 0, digest)
        data = raw_store(pool_client).get(noisy_key)
        assert len(data) == HEADER_BYTES + page, noisy_key
        assert pool_client.remove([noisy_key]) == [0]
        assert put_bytes(pool_client, noisy_key, over_payload(data, os.urandom(page))) == 0

    b = run(model, config, 2, B_BATCHES, log_path=tmp_path / "b.log", reset_local_cache=True)
    notes = connector_warnings(tmp_path / "b.log")
    *followers, noisy = b.results
    assert [r.finish_reason for r in b.results] == ["length"] * len(b.results)
    assert [r.num_cached_tokens for r in followers] == EXPECTED_HITS, notes
    assert [r.token_ids for r in followers] == reference[: len(FOLLOWERS)], notes
    assert noisy.num_cached_tokens == NOISY_HIT
    assert noisy.token_ids != reference[-1], "the noisy KV loaded from the pool was used"
    loaded = counter(b, "transfer_blocks", **FULL, operation="load")
    assert loaded == sum(EXPECTED_HITS) // BLOCK + NOISY_HIT // BLOCK, notes
    # Both ranks read the one object of each block.
    assert counter(b, "transfer_bytes", **FULL, operation="load") == 2 * loaded * page, notes

    # TP=1, the same single shard: the same keys (the fingerprint leaves the TP size out).
    c = run(model, config, 1, B_BATCHES, log_path=tmp_path / "c.log", reset_local_cache=True)
    assert logged_keyspace(tmp_path / "c.log", pool_settings.cache_prefix)[0] == keyspace
    assert rank_block_bytes(tmp_path / "c.log") == [page]  # the same bytes per block as a TP=2 rank
    *followers, noisy = c.results
    notes = connector_warnings(tmp_path / "c.log")
    # At least A's blocks (B stored its prompts' further blocks too).
    assert all(r.num_cached_tokens >= hit for r, hit in zip(followers, EXPECTED_HITS)), notes
    assert [r.token_ids for r in followers] == reference[: len(FOLLOWERS)], notes
    assert noisy.num_cached_tokens >= NOISY_HIT
    assert noisy.token_ids != reference[-1], "the noisy KV loaded from the pool was used"
