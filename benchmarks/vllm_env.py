"""Real vLLM schedulers and requests for the benchmarks (patterns of ``tests/scheduler_env.py``).

A ``Scheduler`` is vLLM's own, built from a tiny Gemma3 checkpoint and a
KV-cache config made from compact group descriptions, with any KV connector
(ours by module path, vLLM's in-tree ones by name) or none.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import MODELS_DIR

_ids = itertools.count()
_registered = False

#: Longest prompt the lookup benchmark asks about, plus room.
LONG_CONTEXT = 40_000


@dataclass(frozen=True)
class GroupDesc:
    """One KV-cache group: ``full``, ``sliding_window`` (with ``window``) or ``mamba``."""

    kind: str
    block_size: int = 32
    window: int = 0


def tiny_long_model() -> Path:
    """A tiny random Gemma3 checkpoint whose context fits the longest benchmark prompt."""
    from kvpool.connector.tiny_models import build_gemma3

    return build_gemma3(MODELS_DIR / "bench-gemma3-tiny-64k", max_position_embeddings=65536)


def ensure_registry() -> None:
    """vLLM registers its spec→manager map at engine start; do it once here."""
    global _registered
    if not _registered:
        from vllm.config import VllmConfig
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

        register_all_kvcache_specs(VllmConfig())
        _registered = True


def make_spec(desc: GroupDesc, head_size: int = 8) -> Any:
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
        return SlidingWindowSpec(**common, sliding_window=desc.window)
    if desc.kind == "mamba":
        return MambaSpec(
            block_size=desc.block_size, shapes=((2, 4),), dtypes=(torch.float32,), mamba_cache_mode="align"
        )
    raise ValueError(desc.kind)


def make_kv_cache_config(groups: list[GroupDesc], num_blocks: int) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], make_spec(g)) for i, g in enumerate(groups)],
    )


def block_sizes(groups: list[GroupDesc]) -> tuple[int, int]:
    """(scheduler_block_size, hash_block_size) as vLLM resolves them."""
    sizes = [g.block_size for g in groups]
    if len(sizes) == 1:
        return sizes[0], sizes[0]
    return math.lcm(*sizes), math.gcd(*sizes)


def engine_config(
    model_dir: Path,
    transfer: dict[str, Any] | None,
    *,
    max_model_len: int = LONG_CONTEXT,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
) -> Any:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,
        block_size=32,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens or max_model_len,
        enable_prefix_caching=True,
        enforce_eager=True,
        dtype="float32",
        kv_transfer_config=None if transfer is None else KVTransferConfig(**transfer),
    )
    return args.create_engine_config()


def ours_transfer(pool_address: str, cache_prefix: str, **extra: Any) -> dict[str, Any]:
    """``KVTransferConfig`` fields loading KVPoolConnector by module path."""
    return {
        "kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "master_server_address": pool_address,
            "cache_prefix": cache_prefix,
            **extra,
        },
    }


def make_scheduler(
    model_dir: Path,
    groups: list[GroupDesc],
    transfer: dict[str, Any] | None,
    *,
    num_blocks: int = 4096,
    max_model_len: int = LONG_CONTEXT,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
) -> Any:
    """vLLM's ``Scheduler`` with the connector ``transfer`` names (None: no connector)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    ensure_registry()
    vllm_config = engine_config(
        model_dir,
        transfer,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    kv_cache_config = make_kv_cache_config(groups, num_blocks=num_blocks)
    scheduler_block, hash_block = block_sizes(groups)
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=scheduler_block,
        hash_block_size=hash_block,
        log_stats=True,
    )


def make_request(scheduler: Any, prompt: list[int], max_tokens: int = 4) -> Any:
    """A ``Request`` hashed as ``scheduler``'s engine would hash it (sha256)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_block = scheduler.kv_cache_manager.block_pool.hash_block_size
    init_none_hash(get_hash_fn_by_name("sha256"))
    return Request(
        request_id=f"req-{next(_ids)}",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        pooling_params=None,
        block_hasher=get_request_block_hasher(hash_block, get_hash_fn_by_name("sha256")),
    )


def random_prompt(rng: random.Random, length: int, vocab: int = 500) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(length)]
