"""What of vLLM's model, platform and speculative settings changes the bytes of a block.

Beyond the layout's shape and the cache dtype, the same tokens get other KV from: another
vLLM (its kernels' block formats), other activations (the model dtype under a quantized
cache), model settings the name and revision do not carry (another config file, remote code,
weights or online quantization; LongRoPE's factors, chosen by ``max_model_len``), another
attention kernel's block format (vLLM's CPU kernels pack a block per instruction set), and
another speculative drafter (its layers' KV shares the target's groups). Each is read from
configuration only, so the scheduler and every worker of a deployment agree.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

from vllm.v1.kv_cache_interface import AttentionSpec, UniformTypeKVCacheSpecs

#: RoPE types whose factors vLLM picks from ``max_model_len`` (Phi-3's LongRoPE).
_LENGTH_CHOSEN_ROPE = frozenset({"longrope", "su"})


def digest(value: Any) -> str:
    """A short, stable digest of a JSON-like value."""
    text = json.dumps(value, sort_keys=True, default=_plain, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _plain(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(map(str, value))
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return str(value)


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def model_settings(model_config: Any) -> str:
    """A digest of the model settings beyond its name and revision that change its KV ("" when
    none is set): its config file, remote-code revision, weights path, online quantization,
    and the RoPE variant ``max_model_len`` picks."""
    settings = {
        name: value
        for name in ("hf_config_path", "code_revision", "model_weights", "quantization_config")
        if (value := getattr(model_config, name, None))
    }
    rope = rope_variant(model_config)
    if rope:
        settings["rope"] = rope
    return digest(settings) if settings else ""


def rope_variant(model_config: Any) -> str:
    """``longrope:long`` or ``longrope:short`` where vLLM picks LongRoPE's factors from
    ``max_model_len`` (longer than the original context: the long factors), ``longrope:auto-fit``
    where that length was fitted after the model was built; else ""."""
    config = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    if config is None:
        return ""
    max_model_len = getattr(model_config, "max_model_len", None)
    # Auto-fit (``--max-model-len -1``): the model was built with the length its config allows,
    # and max_model_len lowered afterwards; every such engine built it alike.
    auto_fit = getattr(model_config, "original_max_model_len", None) == -1
    for params in _rope_parameters(config):
        kind = params.get("rope_type") or params.get("type")
        if kind not in _LENGTH_CHOSEN_ROPE:
            continue
        original = params.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None
        )
        if auto_fit:
            return "longrope:auto-fit"
        if isinstance(max_model_len, int) and isinstance(original, int):
            return "longrope:long" if max_model_len > original else "longrope:short"
        return f"longrope:{max_model_len}"
    return ""


def _rope_parameters(config: Any) -> Iterator[Mapping[str, Any]]:
    """The config's RoPE parameter dicts (one, or one per layer type)."""
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(config, name, None)
        if not isinstance(params, Mapping):
            continue
        if any(isinstance(v, Mapping) for v in params.values()):
            yield from (v for v in params.values() if isinstance(v, Mapping))
        else:
            yield params


def attention_kernel(vllm_config: Any, kv_cache_config: Any) -> str:
    """The platform and attention kernel that write the blocks: the device type, the backend
    when one is chosen, and on the CPU each attention group's instruction set (vLLM's CPU
    kernels lay a block out per ISA: ``amx`` packs what ``vec`` keeps in rows)."""
    from vllm.platforms import current_platform

    parts = [str(getattr(current_platform, "device_type", "") or "unknown")]
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    if backend is not None:
        parts.append(f"backend={getattr(backend, 'name', backend)}")
    if current_platform.is_cpu():
        parts.append("isa=" + "|".join(sorted(_cpu_isas(vllm_config, kv_cache_config))))
        parts.append(_cpu_features())
    return ";".join(parts)


def _cpu_isas(vllm_config: Any, kv_cache_config: Any) -> set[str]:
    """The instruction set vLLM's CPU attention picks for each attention group, as it does, from
    the group's spec as the scheduler sees it (a uniform-type group: its first layer's; the
    host's features stand for the rest)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    dtype = vllm_config.model_config.dtype
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    isas = set()
    for group in getattr(kv_cache_config, "kv_cache_groups", ()):
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = next(iter(spec.kv_cache_specs.values()))
        if isinstance(spec, AttentionSpec):
            try:
                isas.add(_get_attn_isa(dtype, spec.block_size, spec.head_size, cache_dtype))
            except NotImplementedError:  # vLLM refuses this cache on this CPU: it never runs
                isas.add("unsupported")
    return isas


def _cpu_features() -> str:
    """What of the host decides vLLM's CPU kernels: AMX, AVX-512 and the architecture."""
    import torch
    from vllm.platforms import current_platform

    amx = int(bool(torch.cpu._is_amx_tile_supported()))
    avx512 = int(bool(torch.cpu._is_avx512_supported()))
    arch = getattr(current_platform.get_cpu_architecture(), "name", "unknown")
    return f"cpu={arch},amx={amx},avx512={avx512}"


def speculative(vllm_config: Any) -> str:
    """The drafter whose layers' KV the blocks may hold: method, model and revision ("" without)."""
    config = getattr(vllm_config, "speculative_config", None)
    if config is None:
        return ""
    method = getattr(config, "method", None)
    fields = [
        str(getattr(method, "value", method) or ""),
        str(getattr(config, "model", None) or ""),
        str(getattr(config, "revision", None) or ""),
    ]
    return ":".join(fields)
