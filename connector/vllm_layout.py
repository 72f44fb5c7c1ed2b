"""Build the contract's ``KVLayout`` from vLLM's real ``KVCacheConfig``."""

from __future__ import annotations

from typing import Any

from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kvpool.connector.contract.layout import GroupKind, KVGroup, KVLayout


class UnsupportedSpec(ValueError):
    """A KV-cache spec class the connector does not know how to store."""


def group_kind(spec: KVCacheSpec) -> GroupKind:
    """The contract's kind for one of vLLM's KV-cache specs."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = next(iter(spec.kv_cache_specs.values()))
    # Order matters: cross and chunked specs are attention specs too.
    if isinstance(spec, CrossAttentionSpec):
        return GroupKind.CROSS
    if isinstance(spec, SlidingWindowSpec):
        return GroupKind.SLIDING_WINDOW
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return GroupKind.CHUNKED_LOCAL
    if isinstance(spec, MambaSpec):
        return GroupKind.MAMBA
    if isinstance(spec, FullAttentionSpec):
        return GroupKind.FULL
    raise UnsupportedSpec(f"KV-cache spec {type(spec).__name__} is not supported by KVPoolConnector")


def layout_from_vllm(vllm_config: Any, kv_cache_config: KVCacheConfig, model_id: str = "") -> KVLayout:
    """The layout vLLM will run, in the contract's terms."""
    groups: list[KVGroup] = []
    dtypes: set[str] = set()
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        kind = group_kind(spec)
        if isinstance(spec, AttentionSpec):
            dtypes.add(str(spec.dtype).removeprefix("torch."))
        elif isinstance(spec, MambaSpec):
            dtypes.update(str(d).removeprefix("torch.") for d in spec.dtypes)
        groups.append(
            KVGroup(
                kind=kind,
                block_size=spec.block_size,
                sliding_window=getattr(spec, "sliding_window", None)
                if kind == GroupKind.SLIDING_WINDOW
                else None,
                attention_chunk_size=getattr(spec, "attention_chunk_size", None)
                if kind == GroupKind.CHUNKED_LOCAL
                else None,
                mamba_cache_mode=getattr(spec, "mamba_cache_mode", None) if kind == GroupKind.MAMBA else None,
                num_layers=max(1, len(group.layer_names)),
                page_size_bytes=spec.page_size_bytes,
                prefix_cacheable=spec.prefix_cacheable,
                eagle=bool(getattr(group, "is_eagle_group", False)),
            )
        )
    parallel = vllm_config.parallel_config
    _, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    return KVLayout(
        model=model_id or str(vllm_config.model_config.model),
        dtype=",".join(sorted(dtypes)) or "auto",
        groups=groups,
        hash_block_size=hash_block_size,
        cache_block_size=vllm_config.cache_config.block_size,
        tp_size=parallel.tensor_parallel_size,
        pp_size=parallel.pipeline_parallel_size,
        pcp_size=getattr(parallel, "prefill_context_parallel_size", 1),
        dcp_size=getattr(parallel, "decode_context_parallel_size", 1),
    )
