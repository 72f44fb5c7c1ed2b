"""Build the contract's ``KVLayout`` from vLLM's real ``KVCacheConfig``."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED, resolve_kv_cache_block_sizes
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

from kvpool.connector.contract.identity import (
    NON_CRYPTOGRAPHIC_BLOCK_HASHES,
    KVIdentity,
    fingerprint_inputs,
    seed_digest,
)
from kvpool.connector.contract.layout import GroupKind, KVGroup, KVLayout
from kvpool.connector.contract.shards import kv_shards_of
from kvpool.connector.observability.logs import get_logger
from kvpool.connector.vllm_identity import attention_kernel, model_settings, speculative, vllm_version

logger = get_logger(__name__)

#: Cache dtype names vLLM treats as the same format.
_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}


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


def scheduler_view(spec: KVCacheSpec) -> KVCacheSpec:
    """The spec as vLLM hands it to the scheduler: a uniform-type group as its first layer's spec.

    Workers keep ``UniformTypeKVCacheSpecs`` (whose page size sums every layer);
    ``generate_scheduler_kv_cache_config`` gives the scheduler the first layer's
    spec. Describing both by that spec makes every process build the same layout.
    """
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return next(iter(spec.kv_cache_specs.values()))
    return spec


def layout_from_vllm(vllm_config: Any, kv_cache_config: KVCacheConfig, model_id: str = "") -> KVLayout:
    """The layout vLLM will run, in the contract's terms."""
    groups: list[KVGroup] = []
    dtypes: set[str] = set()
    for group in kv_cache_config.kv_cache_groups:
        spec = scheduler_view(group.kv_cache_spec)
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
        kv_shards=_kv_shards(vllm_config, kv_cache_config),
    )


def _kv_shards(vllm_config: Any, kv_cache_config: KVCacheConfig) -> int | None:
    """The attention groups' KV shards when tensor ranks hold copies of them; None when each
    rank holds its own KV (or when anything disagrees: one object per rank is always right).

    Copies only without context parallelism (which splits tokens over the ranks of a head),
    and only when every attention layer's per-rank heads (and vLLM's ``max_tp_shards``,
    where published) are what the shard split implies.
    """
    parallel, model = vllm_config.parallel_config, vllm_config.model_config
    tp_size = parallel.tensor_parallel_size
    if getattr(parallel, "prefill_context_parallel_size", 1) > 1:
        return None
    if getattr(parallel, "decode_context_parallel_size", 1) > 1:
        return None
    try:
        use_mla = bool(model.use_mla)
        shards = kv_shards_of(tp_size, int(model.get_total_num_kv_heads()), use_mla)
    except Exception:  # a model config without these: one object per rank
        return None
    if shards >= tp_size or tp_size % shards != 0:
        return None
    heads_per_rank = 1 if use_mla else max(1, model.get_total_num_kv_heads() // tp_size)
    for group in kv_cache_config.kv_cache_groups:
        if getattr(group, "is_eagle_group", False):
            continue
        spec = group.kv_cache_spec
        layers = spec.kv_cache_specs.values() if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
        for layer in layers:
            if not isinstance(layer, AttentionSpec):
                continue
            published = getattr(layer, "max_tp_shards", None)  # vLLM's own word, where a backend gives it
            if layer.num_kv_heads != heads_per_rank or (
                published is not None and min(tp_size, published) != shards
            ):
                return None
    return shards


def identity_from_vllm(vllm_config: Any, kv_cache_config: KVCacheConfig) -> KVIdentity:
    """The non-shape inputs of the key fingerprint, as vLLM will run them.

    Reads only what the scheduler and every worker see alike (configuration and
    environment), so all processes of one deployment agree on it.
    """
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    algorithm = str(getattr(cache, "prefix_caching_hash_algo", "sha256"))
    return KVIdentity(
        cache_dtype=_CACHE_DTYPE_ALIASES.get(str(cache.cache_dtype), str(cache.cache_dtype)),
        kv_quantization=_kv_quantization(cache, kv_cache_config),
        model_revision=str(getattr(model, "revision", None) or ""),
        weight_quantization=str(getattr(model, "quantization", None) or ""),
        hf_overrides=_overrides_digest(getattr(model, "hf_overrides", None)),
        kv_cache_layout=str(
            getattr(kv_cache_config, "kv_cache_layout", None) or getattr(cache, "kv_cache_layout", None) or ""
        ),
        block_hash_algorithm=algorithm,
        pp_layer_partition=os.environ.get("VLLM_PP_LAYER_PARTITION", ""),
        block_hash_seed=_hash_seed(algorithm),
        vllm_version=vllm_version(),
        model_dtype=str(getattr(model, "dtype", "") or ""),
        model_settings=model_settings(model),
        attention_kernel=attention_kernel(vllm_config, kv_cache_config),
        speculative=speculative(vllm_config),
    )


def _kv_quantization(cache: Any, kv_cache_config: Any) -> str:
    """Quantization beyond the cache dtype: the specs' quantization modes, skipped layers, Mamba dtypes."""
    parts = []
    modes = {
        str(getattr(mode, "name", mode))
        for group in getattr(kv_cache_config, "kv_cache_groups", ())
        if (mode := getattr(scheduler_view(group.kv_cache_spec), "kv_quant_mode", None)) is not None
    }
    modes.discard("NONE")
    if modes:
        parts.append("mode=" + "|".join(sorted(modes)))
    skipped = list(getattr(cache, "kv_cache_dtype_skip_layers", None) or [])
    if skipped:
        parts.append("skip=" + "|".join(sorted(str(s) for s in skipped)))
    for name in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
        value = str(getattr(cache, name, "auto") or "auto")
        if value != "auto":
            parts.append(f"{name}={value}")
    return ";".join(parts) or "none"


def _overrides_digest(overrides: Any) -> str:
    """A digest of hf_overrides (a dict, or a callable named by its qualified name)."""
    if not overrides:
        return ""
    if callable(overrides):
        text = f"{getattr(overrides, '__module__', '')}.{getattr(overrides, '__qualname__', repr(overrides))}"
        logger.warning(
            "KVPoolConnector: hf_overrides is a callable (%s); the key fingerprint knows it by that "
            "name only: give each model a callable makes differently its own model_id",
            text,
        )
    else:
        text = json.dumps(overrides, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _hash_seed(algorithm: str) -> str:
    """The block-hash seed, as vLLM resolves it, as a digest ("per-process" when random)."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is not None:
        return seed_digest(seed)
    if algorithm in NON_CRYPTOGRAPHIC_BLOCK_HASHES:  # seeded at random per process
        return "per-process"
    return seed_digest(DEFAULT_NONE_HASH_SEED)


def key_fingerprint_from_vllm(vllm_config: Any, kv_cache_config: KVCacheConfig, layout: KVLayout) -> str:
    """The fingerprint of this deployment's store keys; logs every input it digests."""
    return key_fingerprint_inputs_from_vllm(vllm_config, kv_cache_config, layout)["fingerprint"]


def key_fingerprint_inputs_from_vllm(
    vllm_config: Any, kv_cache_config: KVCacheConfig, layout: KVLayout
) -> dict[str, str]:
    """The key fingerprint (``fingerprint``) and every input it digests; logs them."""
    identity = identity_from_vllm(vllm_config, kv_cache_config)
    inputs = fingerprint_inputs(layout, identity)
    logger.info(
        "KVPoolConnector key fingerprint %s from %s",
        inputs["fingerprint"],
        " ".join(f"{name}={value}" for name, value in inputs.items() if name != "fingerprint"),
    )
    return inputs
