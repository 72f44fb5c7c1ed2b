"""The benchmarks' vLLM schedulers: ``testing.scheduler`` at benchmark sizes.

A ``Scheduler`` is vLLM's own, built from a tiny Gemma3 checkpoint with a long
context and a KV-cache config made from compact group descriptions, with any
KV connector (ours by module path, vLLM's in-tree ones by name) or none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.common import MODELS_DIR
from testing.kv_cache import GroupDesc
from testing.scheduler import make_scheduler, pool_transfer

#: Longest prompt the lookup benchmark asks about, plus room.
LONG_CONTEXT = 40_000


def tiny_long_model() -> Path:
    """A tiny random Gemma3 checkpoint whose context fits the longest benchmark prompt."""
    from testing.models import build_gemma3

    return build_gemma3(MODELS_DIR / "bench-gemma3-tiny-64k", max_position_embeddings=65536)


def ours_transfer(pool_address: str, cache_prefix: str, **extra: Any) -> dict[str, Any]:
    """``KVTransferConfig`` fields loading KVPoolConnector by module path."""
    return pool_transfer({"master_server_address": pool_address, "cache_prefix": cache_prefix, **extra})


def bench_scheduler(
    model_dir: Path,
    groups: list[GroupDesc],
    transfer: dict[str, Any] | None,
    *,
    num_blocks: int = 4096,
    max_model_len: int = LONG_CONTEXT,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
) -> Any:
    """vLLM's ``Scheduler`` at benchmark sizes (a batch holds a whole context unless told otherwise)."""
    return make_scheduler(
        model_dir,
        groups,
        transfer,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens or max_model_len,
    )


def bench_engine_config(model_dir: Path, transfer: dict[str, Any] | None) -> Any:
    """vLLM's config of a benchmark scheduler (for connector halves built outside one)."""
    from testing.scheduler import engine_config

    return engine_config(
        model_dir, transfer, max_model_len=LONG_CONTEXT, max_num_seqs=256, max_num_batched_tokens=LONG_CONTEXT
    )
