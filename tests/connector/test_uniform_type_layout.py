"""Scheduler and workers describe a uniform-type KV-cache group identically.

vLLM hands workers ``UniformTypeKVCacheSpecs`` (page size summed over layers)
and the scheduler the first layer's spec (``generate_scheduler_kv_cache_config``).
Both must build the same layout and key fingerprint, or no key ever matches.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVQuantMode,
    UniformTypeKVCacheSpecs,
)

from kvpool.connector.contract.identity import key_fingerprint
from kvpool.connector.vllm_layout import identity_from_vllm, layout_from_vllm


def _vllm_config() -> SimpleNamespace:
    """The config fields layout_from_vllm and identity_from_vllm read (no model needed)."""
    cache = SimpleNamespace(
        block_size=32,
        prefix_match_unit=None,
        enable_prefix_caching=True,
        cache_dtype="fp8_e4m3",
        prefix_caching_hash_algo="sha256",
        kv_cache_dtype_skip_layers=[],
        mamba_cache_dtype="auto",
        mamba_ssm_cache_dtype="auto",
        kv_cache_layout=None,
    )
    parallel = SimpleNamespace(
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        prefill_context_parallel_size=1,
        decode_context_parallel_size=1,
    )
    model = SimpleNamespace(
        model="m", revision=None, quantization=None, hf_overrides={}, dtype=torch.bfloat16, max_model_len=4096
    )
    return SimpleNamespace(cache_config=cache, parallel_config=parallel, model_config=model)


def test_uniform_type_group_is_the_same_layout_on_scheduler_and_worker() -> None:
    def spec(head_size: int) -> FullAttentionSpec:
        return FullAttentionSpec(
            block_size=32,
            num_kv_heads=1,
            head_size=head_size,
            dtype=torch.uint8,
            kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
        )

    uniform = UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs={"l0": spec(64), "l1": spec(128)})
    worker = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], uniform)]
    )
    scheduler = generate_scheduler_kv_cache_config([worker])
    assert not isinstance(scheduler.kv_cache_groups[0].kv_cache_spec, UniformTypeKVCacheSpecs)
    config = _vllm_config()
    on_worker = layout_from_vllm(config, worker)
    on_scheduler = layout_from_vllm(config, scheduler)
    assert on_worker == on_scheduler
    assert on_worker.groups[0].page_size_bytes == spec(64).page_size_bytes
    identity = identity_from_vllm(config, worker)
    assert identity == identity_from_vllm(config, scheduler)
    assert identity.kv_quantization == "mode=FP8_PER_TENSOR" and identity.cache_dtype == "fp8_e4m3"
    assert key_fingerprint(on_worker, identity) == key_fingerprint(on_scheduler, identity)


def test_layers_of_other_instruction_sets_in_one_group_keep_one_fingerprint() -> None:
    """vLLM's CPU attention picks an ISA per head size (``vec16`` for 80, ``amx`` or ``vec`` for
    128); the scheduler sees a uniform-type group as its first layer, so the kernel part of
    the identity is the same there and on the worker."""

    def spec(head_size: int) -> FullAttentionSpec:
        return FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=head_size, dtype=torch.bfloat16)

    uniform = UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs={"l0": spec(80), "l1": spec(128)})
    worker = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], uniform)]
    )
    scheduler = generate_scheduler_kv_cache_config([worker])
    config = _vllm_config()
    config.cache_config.cache_dtype = "auto"
    on_worker, on_scheduler = identity_from_vllm(config, worker), identity_from_vllm(config, scheduler)
    assert on_worker.attention_kernel == on_scheduler.attention_kernel
    assert on_worker.attention_kernel.startswith("cpu;isa=vec16;cpu=")
    assert on_worker == on_scheduler


def test_start_up_logs_every_fingerprint_input_never_the_seed(monkeypatch) -> None:
    import logging

    from kvpool.connector import vllm_layout

    monkeypatch.setenv("PYTHONHASHSEED", "31337")
    spec = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
    )
    config = _vllm_config()
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    vllm_layout.logger.addHandler(handler)
    monkeypatch.setattr(vllm_layout.logger, "level", logging.INFO)
    try:
        layout = layout_from_vllm(config, kv_cache_config)
        printed = vllm_layout.key_fingerprint_from_vllm(config, kv_cache_config, layout)
    finally:
        vllm_layout.logger.removeHandler(handler)
    assert printed == key_fingerprint(layout, identity_from_vllm(config, kv_cache_config))
    (line,) = [text for text in lines if "key fingerprint" in text]
    for needle in (printed, "cache_dtype=fp8_e4m3", "block_hash_algorithm=sha256", "model_revision="):
        assert needle in line
    assert "31337" not in line
