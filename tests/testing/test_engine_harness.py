"""Smoke test: a real vLLM CPU engine on the tiny Gemma3 model is deterministic.

The same prompts, greedy, in two separate engines (one in this process, one in
a fresh process) give identical tokens and log-probabilities. This is what the
connector tests rely on to compare "engine B loaded KV from the store" with a
reference run.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from testing.engine import EngineOptions, run_engine, run_engine_subprocess
from testing.models import STAMP_FILE, build_gemma3

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3(tmp_path_factory.mktemp("models") / "gemma3-tiny")


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    long = [rng.randrange(3, 512) for _ in range(300)]  # > sliding window (64)
    return [long, long[:200] + [rng.randrange(3, 512) for _ in range(40)]]


def test_build_is_idempotent(gemma3_dir: Path) -> None:
    stamp = (gemma3_dir / STAMP_FILE).read_text()
    mtime = (gemma3_dir / "model.safetensors").stat().st_mtime_ns
    assert build_gemma3(gemma3_dir) == gemma3_dir
    assert (gemma3_dir / "model.safetensors").stat().st_mtime_ns == mtime
    assert (gemma3_dir / STAMP_FILE).read_text() == stamp
    cfg = json.loads((gemma3_dir / "config.json").read_text())
    assert {"sliding_attention", "full_attention"} <= set(cfg["layer_types"])


def test_two_engines_give_identical_outputs(gemma3_dir: Path) -> None:
    opts = EngineOptions(model=str(gemma3_dir))
    prompts = _prompts()
    here = run_engine(opts, [prompts], max_tokens=12, logprobs=True)
    fresh = run_engine_subprocess(opts, [prompts], max_tokens=12, logprobs=True)

    assert here.token_ids == fresh.token_ids
    assert [r.logprobs for r in here.results] == [r.logprobs for r in fresh.results]
    assert all(len(t) == 12 for t in here.token_ids)
    assert here.token_ids[0] != here.token_ids[1]
    # Hybrid KV cache manager on: sliding-window groups next to a full-attention group.
    specs = {g["spec"] for g in here.kv_cache_config["groups"]}
    assert specs == {"SlidingWindowSpec", "FullAttentionSpec"}
