"""Real vLLM KV-cache configs and coordinators built from compact group descriptions."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

_registered = False


def ensure_registry() -> None:
    """vLLM registers its spec→manager map at engine start; do it once here."""
    global _registered
    if not _registered:
        from vllm.config import VllmConfig
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

        register_all_kvcache_specs(VllmConfig())
        _registered = True


@dataclass(frozen=True)
class GroupDesc:
    """One KV-cache group: ``full``, ``sliding_window`` (with ``window``) or ``mamba``."""

    kind: str
    block_size: int = 32
    window: int = 0
    eagle: bool = False
    speculative_blocks: int = 0  # mamba: vLLM's num_speculative_blocks
    # sliding_window: tokens vLLM keeps below the window (multi-module MTP's lookahead - 1)
    retained: int = 0


def make_spec(desc: GroupDesc, head_size: int = 8) -> Any:
    """vLLM's ``KVCacheSpec`` for ``desc`` (one float32 KV head)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    common = {
        "block_size": desc.block_size,
        "num_kv_heads": 1,
        "head_size": head_size,
        "dtype": torch.float32,
    }
    if desc.kind == "full":
        return FullAttentionSpec(**common)
    if desc.kind == "sliding_window":
        return SlidingWindowSpec(**common, sliding_window=desc.window, extra_retained_tokens=desc.retained)
    if desc.kind == "mamba":
        return MambaSpec(
            block_size=desc.block_size,
            shapes=((2, 4),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align",
            num_speculative_blocks=desc.speculative_blocks,
        )
    raise ValueError(desc.kind)


def make_kv_cache_config(groups: list[GroupDesc], num_blocks: int = 4096) -> Any:
    """vLLM's ``KVCacheConfig``: one layer per group, no tensors."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"layer.{i}"], make_spec(g), is_eagle_group=g.eagle)
            for i, g in enumerate(groups)
        ],
    )


def block_sizes(groups: list[GroupDesc]) -> tuple[int, int]:
    """(scheduler_block_size, hash_block_size) as vLLM resolves them."""
    sizes = [g.block_size for g in groups]
    if len(sizes) == 1:
        return sizes[0], sizes[0]
    return math.lcm(*sizes), math.gcd(*sizes)


def make_coordinator(groups: list[GroupDesc], max_model_len: int = 8192) -> Any:
    """vLLM's real coordinator (hybrid for several groups) with caching on."""
    from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator

    ensure_registry()
    config = make_kv_cache_config(groups)
    scheduler_block, hash_block = block_sizes(groups)
    return get_kv_cache_coordinator(
        config,
        max_model_len=max_model_len,
        max_in_flight_tokens=max_model_len,
        use_eagle=any(g.eagle for g in groups),
        enable_caching=True,
        enable_kv_cache_events=False,
        dcp_world_size=1,
        pcp_world_size=1,
        scheduler_block_size=scheduler_block,
        hash_block_size=hash_block,
        allow_partial_hash_hits=False,
    )


def fill_block_pool(coordinator: Any, present: dict[int, set[bytes]]) -> None:
    """Make the real block pool hold a cached block for each (group, hash)."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    pool = coordinator.block_pool
    next_id = 1
    for group_id, hashes in present.items():
        for block_hash in hashes:
            block = pool.blocks[next_id]
            next_id += 1
            pool.cached_block_hash_to_block.insert(make_block_hash_with_group_id(block_hash, group_id), block)


def pipeline_stage_configs(model: Any, block_size: int, kv_memory_bytes: int) -> tuple[Any, list[Any], Any]:
    """vLLM's config and each stage's ``KVCacheConfig`` (and the scheduler's) for ``model`` at
    PP=2, float32, as its engine core computes them (the layout probe builds each stage's model
    on ``meta``; vLLM 0.32's CPU engine cannot run PP=2 whole)."""
    from kvpool.connector.local.layout_probe import kv_cache_configs

    args = {
        "model": str(model),
        "pipeline_parallel_size": 2,
        "block_size": block_size,
        "dtype": "float32",
        "max_model_len": 1024,
        "enable_prefix_caching": True,
    }
    return kv_cache_configs(args, kv_memory_bytes=kv_memory_bytes)
