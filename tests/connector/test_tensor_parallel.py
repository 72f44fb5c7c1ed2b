"""Tensor parallelism on real engines: TP=2 engines store and load through a real pool.

Engine A (TP=2: two worker processes, each with half the KV heads, each pinned to its
own core as vLLM's CPU workers are) serves a 700-token prompt, and a second one, and
exits. Between A and B the test takes two of A's objects apart, as a rank killed in the
middle of its saves or a damaged object would leave them:

* rank 1's object of block 15 is removed (rank 0's stays): a block only some ranks
  published is no hit;
* rank 1's object of block 20 is replaced by a short one: the lookup sees every rank's key,
  rank 1's load fails its check, and the request recomputes (vLLM's default
  ``kv_load_failure_policy`` is in force: a failed load must not fail the request);
* every object of the second prompt gets noise for its K/V bytes (headers kept, stating the noise's CRC): the
  negative control.

A fresh TP=2 engine B then serves prompts sharing the first 100, 333, 650 and 700 tokens
of the first prompt, one after another, its own prefix cache emptied after each (so every
hit comes from the pool), then one sharing the noisy prompt's prefix. B's outputs equal a
TP=2 engine's without any connector, except the negative control's; the hits are the
whole blocks of each shared prefix, up to the block only one rank published. The
counters count each block once (not once per rank); bytes count both ranks.

On the hybrid Gemma3 (sliding window and full attention: a failed load sends the request
back whole); every load is asynchronous. How ranks split and publish objects does not
depend on the model's groups: a one-group model's failed load (its block ids handed back)
is checked on a TP=1 engine (``test_engine_pool.py``), where it costs a third of this.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import pytest

from kvpool.connector.contract.keys import KeySpace, hash_digest
from kvpool.connector.contract.object_header import HEADER_BYTES
from kvpool.connector.contract.settings import ConnectorSettings
from testing.engine import (
    PATIENT_DEADLINES,
    EngineOptions,
    EngineReport,
    run_engine_subprocess,
    transfer_config,
)
from testing.models import build_gemma3
from testing.objects import over_payload
from testing.pool_store import put_bytes, raw_store
from testing.prompts import BLOCK, block_hashes

pytestmark = [pytest.mark.engine, pytest.mark.mooncake]

TP = 2
#: What a TP=2 CPU engine needs here: one OpenMP thread per rank, each on its own core. vLLM
#: stops a worker 5 s into shutdown (its saves in flight die with it): here it gets longer.
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "60"}
MAX_TOKENS = 8
_rng = random.Random(718)
LONG = [_rng.randrange(3, 500) for _ in range(700)]
NOISY = [_rng.randrange(3, 500) for _ in range(400)]
SHARED = (100, 333, 650, 700)
#: Prompts sharing LONG's first n tokens, then their own; and one sharing NOISY's first 333.
FOLLOWERS = [LONG[:n] + [_rng.randrange(3, 500) for _ in range(24)] for n in SHARED]
NOISY_FOLLOWER = NOISY[:333] + [_rng.randrange(3, 500) for _ in range(24)]
PARTIAL_BLOCK = 15  # only rank 0 published it
DAMAGED_BLOCK = 20  # rank 1's object is short
#: Whole blocks of each shared prefix, up to the block only one rank published.
EXPECTED_HITS = [96, 320, PARTIAL_BLOCK * BLOCK]
NOISY_HIT = 320


def tp_options(model: Path, config: dict[str, Any] | None, **extra: Any) -> EngineOptions:
    return EngineOptions(
        model=str(model),
        kv_transfer_config=config,
        dtype="float32",
        llm_kwargs={"tensor_parallel_size": TP, "distributed_executor_backend": "mp"},
        **extra,
    )


def run_tp(opts: EngineOptions, batches: list[list[list[int]]], **kwargs: Any) -> EngineReport:
    return run_engine_subprocess(opts, batches, MAX_TOKENS, env=TP_ENV, **kwargs)


def b_batches() -> list[list[list[int]]]:
    return [[p] for p in [*FOLLOWERS, NOISY_FOLLOWER]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3(tmp_path_factory.mktemp("tp-hybrid"))


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    """B's prompts from a TP=2 engine without any connector."""
    return run_tp(tp_options(model_dir, None), b_batches()).token_ids


def logged_keyspace(log: Path, cache_prefix: str) -> tuple[KeySpace, list[str]]:
    """The keyspace and group kinds an engine logged at start-up."""
    text = log.read_text(errors="replace")
    (fingerprint,) = set(re.findall(r"KVPoolConnector key fingerprint ([0-9a-f]{16})", text))
    kinds = re.search(r"KVPoolConnector SCHEDULER: .* groups=\[([^\]]*)\]", text)
    assert kinds is not None, "the scheduler logged its groups"
    return KeySpace(cache_prefix, fingerprint), re.findall(r"'(\w+)'", kinds.group(1))


def connector_warnings(log: Path) -> str:
    """The connector's and Mooncake's complaints in an engine's log (for assertion messages)."""
    lines = log.read_text(errors="replace").splitlines()
    picked = [line for line in lines if ("WARNING" in line and "KVPool" in line) or "RPC_TIMEOUT" in line]
    return "\n".join(picked[-20:])


def rank_block_bytes(log: Path) -> list[int]:
    """Bytes of one block of each group on one rank, as a worker logged them."""
    found = re.search(r"bytes per block by group: \[([0-9, ]+)\]", log.read_text(errors="replace"))
    assert found is not None, "a worker logged its block sizes"
    return [int(v) for v in found.group(1).split(",")]


def test_tp2_engine_b_loads_what_tp2_engine_a_stored(
    model_dir: Path,
    reference: list[list[int]],
    pool_settings: ConnectorSettings,
    pool_client: Any,
    tmp_path: Path,
) -> None:
    config = transfer_config(pool_settings, **PATIENT_DEADLINES)
    del config["kv_load_failure_policy"]  # vLLM's default ("fail") is in force
    run_tp(tp_options(model_dir, config), [[LONG], [NOISY]], log_path=tmp_path / "a.log")
    keyspace, kinds = logged_keyspace(tmp_path / "a.log", pool_settings.cache_prefix)
    full = kinds.index("full")
    hashes = block_hashes(LONG)

    def key(rank: int, block: int, group: int = full, prompt_hashes: list[bytes] = hashes) -> str:
        return keyspace.key(group, rank, 0, hash_digest(prompt_hashes[block]))

    # Every rank stored every block of both prompts.
    stored = [key(r, b) for r in range(TP) for b in range(len(LONG) // BLOCK)]
    assert pool_client.exists(stored) == [True] * len(stored)

    # A block only rank 0 published; rank 1's object of another block cut short.
    assert pool_client.remove([key(1, PARTIAL_BLOCK)]) == [0]
    damaged = key(1, DAMAGED_BLOCK)
    assert pool_client.remove([damaged]) == [0]
    assert put_bytes(pool_client, damaged, b"\0" * 100) == 0
    # Negative control: noise in every K/V byte of the second prompt's shared blocks.
    noisy_hashes = block_hashes(NOISY)
    noisy_keys = [
        key(r, b, g, noisy_hashes)
        for r in range(TP)
        for g in range(len(kinds))
        for b in range(NOISY_HIT // BLOCK)
    ]
    for noisy_key in noisy_keys:
        data = raw_store(pool_client).get(noisy_key)
        assert len(data) > HEADER_BYTES, noisy_key
        assert pool_client.remove([noisy_key]) == [0]
        noise = os.urandom(len(data) - HEADER_BYTES)
        assert put_bytes(pool_client, noisy_key, over_payload(data, noise)) == 0

    b = run_tp(
        tp_options(model_dir, config, disable_log_stats=False),
        b_batches(),
        log_path=tmp_path / "b.log",
        reset_local_cache=True,
    )
    notes = connector_warnings(tmp_path / "b.log")
    *followers, noisy = b.results
    assert [r.finish_reason for r in b.results] == ["length"] * len(b.results)  # none failed
    assert [r.token_ids for r in followers] == reference[: len(FOLLOWERS)]
    assert [r.num_cached_tokens for r in followers[:3]] == EXPECTED_HITS, notes
    # The damaged block: seen present on every rank, its load failed on rank 1, recomputed.
    assert [lookup["hit_tokens"] for lookup in b.lookups][3] == 672
    assert noisy.num_cached_tokens == NOISY_HIT
    assert noisy.token_ids != reference[-1], "the noisy KV loaded from the pool was used"

    # Counters once per block (not once per rank); bytes of both ranks.
    metrics = b.metrics
    assert metrics is not None

    def counter(name: str, **labels: Any) -> float:
        label_text = ",".join(f"{k}={v}" for k, v in labels.items())
        return metrics.get(f"vllm:kvpool_{name}{{{label_text}}}", 0.0)

    full_load = {"group": full, "group_kind": "full", "operation": "load"}
    loaded = counter("transfer_blocks", **full_load)
    # 3, 10 and 15 blocks; 21 for the damaged prompt (rank 0 loaded them all); 10 noisy.
    assert loaded == 3 + 10 + PARTIAL_BLOCK + (DAMAGED_BLOCK + 1) + NOISY_HIT // BLOCK, notes
    page = rank_block_bytes(tmp_path / "b.log")[full]
    # More than one rank's bytes (each rank moves its half of the heads), never more than both.
    assert loaded * page < counter("transfer_bytes", **full_load) <= TP * loaded * page, notes
    assert counter("removed_objects", group=full, group_kind="full", reason="corrupt") == 1
    # The damaged prompt recomputed once, sent back whole (a hybrid model's failed load).
    recomputed = metrics.get("vllm:kvpool_recomputed_requests", 0.0)
    load_errors = metrics.get("vllm:kvpool_load_error_blocks", 0.0)
    assert len(kinds) > 1 and (recomputed, load_errors) == (1, 0)
