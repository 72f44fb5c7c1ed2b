"""The key fingerprint: every input that makes KV bytes or block hashes differ separates keys."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from kvpool.connector.contract.identity import KVIdentity, fingerprint_inputs, key_fingerprint
from kvpool.connector.contract.layout import GroupKind, KVGroup, KVLayout, fingerprint

LAYOUT = KVLayout(model="m", dtype="bfloat16", groups=[KVGroup(kind=GroupKind.FULL, block_size=32)])

VARIANTS = {
    "cache_dtype": ["fp8_e4m3", "fp8_e5m2"],
    "kv_quantization": ["skip=0"],
    "model_revision": ["v2"],
    "weight_quantization": ["awq"],
    "hf_overrides": ["0123456789ab"],
    "kv_cache_layout": ["LBHNC"],
    "block_hash_algorithm": ["sha256_cbor"],
    "block_hash_seed": ["deadbeef0000"],
    "vllm_version": ["0.33.0"],
    "model_dtype": ["torch.float16"],
    "model_settings": ["0123456789ab"],
    "attention_kernel": ["cpu;isa=amx", "cpu;isa=vec"],
    "speculative": ["eagle:org/draft:"],
}


def test_every_identity_input_separates_keys() -> None:
    base = KVIdentity()
    prints = {key_fingerprint(LAYOUT, base)}
    for name, values in VARIANTS.items():
        for value in values:
            prints.add(key_fingerprint(LAYOUT, base.model_copy(update={name: value})))
    assert len(prints) == 1 + sum(len(v) for v in VARIANTS.values())
    # The shape still separates too, and equal inputs give equal keys.
    assert key_fingerprint(LAYOUT.model_copy(update={"tp_size": 2}), base) not in prints
    assert key_fingerprint(LAYOUT, KVIdentity()) == key_fingerprint(LAYOUT, base)


def test_layout_fingerprint_is_unchanged_by_the_identity() -> None:
    """The declared-layout fingerprint the operator renders describes the shape only."""
    inputs = fingerprint_inputs(LAYOUT, KVIdentity(cache_dtype="fp8_e5m2"))
    assert inputs["layout_fingerprint"] == fingerprint(LAYOUT)
    assert inputs["fingerprint"] == key_fingerprint(LAYOUT, KVIdentity(cache_dtype="fp8_e5m2"))
    assert inputs["cache_dtype"] == "fp8_e5m2" and inputs["parallel"] == "tp1-pp1-pcp1-dcp1"


def _configs(**cache: object) -> tuple[SimpleNamespace, SimpleNamespace]:
    """Stand-ins for the few vLLM config fields identity_from_vllm reads (no engine needed)."""
    cache_config = SimpleNamespace(
        **{
            "cache_dtype": "auto",
            "prefix_caching_hash_algo": "sha256",
            "kv_cache_dtype_skip_layers": [],
            "mamba_cache_dtype": "auto",
            "mamba_ssm_cache_dtype": "auto",
            "kv_cache_layout": None,
            **cache,
        }
    )
    model_config = SimpleNamespace(
        revision=None, quantization=None, hf_overrides={}, dtype=torch.float32, max_model_len=4096
    )
    vllm_config = SimpleNamespace(
        cache_config=cache_config, model_config=model_config, speculative_config=None
    )
    return vllm_config, SimpleNamespace(kv_cache_layout=None, kv_cache_groups=[])


def test_identity_reads_vllm_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool.connector.vllm_layout import identity_from_vllm

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    e4m3 = identity_from_vllm(*_configs(cache_dtype="fp8_e4m3"))
    assert e4m3 == identity_from_vllm(*_configs(cache_dtype="fp8"))  # vLLM's alias
    assert e4m3 != identity_from_vllm(*_configs(cache_dtype="fp8_e5m2"))
    assert identity_from_vllm(*_configs(kv_cache_dtype_skip_layers=["0"])).kv_quantization == "skip=0"
    default_seed = identity_from_vllm(*_configs()).block_hash_seed
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    seven = identity_from_vllm(*_configs()).block_hash_seed
    assert seven != default_seed and seven != "7"  # a digest, never the seed itself
    monkeypatch.delenv("PYTHONHASHSEED")
    assert identity_from_vllm(*_configs(prefix_caching_hash_algo="xxhash")).block_hash_seed == "per-process"
    vllm_config, kv_cache_config = _configs()
    vllm_config.model_config.revision = "v2"
    vllm_config.model_config.hf_overrides = {"num_hidden_layers": 2}
    identity = identity_from_vllm(vllm_config, kv_cache_config)
    assert identity.model_revision == "v2" and len(identity.hf_overrides) == 12
    kv_cache_config.kv_cache_layout = "LBHNC"
    assert identity_from_vllm(vllm_config, kv_cache_config).kv_cache_layout == "LBHNC"


def test_a_callable_hf_overrides_is_known_by_name_and_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """Two callables of one qualified name digest alike, so the connector says to tell such
    models apart by model_id."""
    from kvpool.connector import vllm_layout

    def make(layers: int):
        def overrides(config):
            config.num_hidden_layers = layers
            return config

        return overrides

    log = logging.getLogger(vllm_layout.logger.name)
    log.addHandler(caplog.handler)
    try:
        vllm_config, kv_cache_config = _configs()
        vllm_config.model_config.hf_overrides = make(2)
        two = vllm_layout.identity_from_vllm(vllm_config, kv_cache_config).hf_overrides
        vllm_config.model_config.hf_overrides = make(4)
        assert vllm_layout.identity_from_vllm(vllm_config, kv_cache_config).hf_overrides == two
    finally:
        log.removeHandler(caplog.handler)
    assert any(
        "model_id" in r.getMessage() and "make.<locals>.overrides" in r.getMessage() for r in caplog.records
    )


def test_identity_reads_what_changes_the_bytes_beyond_the_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """The vLLM version, the model dtype, model settings beyond its name (config path, code
    revision, weights, online quantization, LongRoPE's length-picked factors), the CPU
    attention kernel's block format, and the speculative drafter each separate keys."""
    import vllm
    from vllm.v1.attention.backends import cpu_attn

    from kvpool.connector.vllm_layout import identity_from_vllm
    from testing.kv_cache import GroupDesc, make_kv_cache_config

    def identity(**model: object) -> KVIdentity:
        vllm_config, kv_cache_config = _configs()
        vllm_config.model_config.__dict__.update(model)
        return identity_from_vllm(vllm_config, kv_cache_config)

    base = identity()
    assert base.vllm_version == vllm.__version__ and base.model_dtype == "torch.float32"
    assert base.model_settings == "" and base.speculative == ""
    assert identity(dtype=torch.bfloat16).model_dtype != base.model_dtype
    for name, value in (
        ("hf_config_path", "/configs/other"),
        ("code_revision", "abc123"),
        ("model_weights", "/weights/v2"),
        ("quantization_config", {"method": "fp8", "ignore": ["lm_head"]}),
    ):
        assert identity(**{name: value}).model_settings not in ("", base.model_settings), name

    # Phi-3's LongRoPE: vLLM takes the long factors when max_model_len passes the original context.
    rope = {"rope_type": "longrope", "original_max_position_embeddings": 4096}
    longrope = SimpleNamespace(rope_parameters=rope)
    short = identity(hf_text_config=longrope, max_model_len=4096).model_settings
    long = identity(hf_text_config=longrope, max_model_len=32768).model_settings
    assert "" != short != long != ""
    # Auto-fit: the model was built before max_model_len was lowered to what fits.
    fitted = identity(hf_text_config=longrope, max_model_len=3000, original_max_model_len=-1).model_settings
    assert fitted not in ("", short, long)
    plain = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert identity(hf_text_config=plain, max_model_len=32768).model_settings == ""

    # vLLM's CPU kernels lay a block out per instruction set: AMX's packing is not VEC's rows.
    vllm_config, _ = _configs()
    kv_cache_config = make_kv_cache_config([GroupDesc("full", 32)])
    kernels = {}
    for isa in ("amx", "vec"):
        monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *args, isa=isa: isa)
        kernels[isa] = identity_from_vllm(vllm_config, kv_cache_config).attention_kernel
    assert kernels["amx"].startswith("cpu;isa=amx;cpu=") and kernels["vec"].startswith("cpu;isa=vec;cpu=")
    assert "amx=" in kernels["amx"] and "avx512=" in kernels["amx"]  # the host's features too

    vllm_config, kv_cache_config = _configs()
    vllm_config.speculative_config = SimpleNamespace(method="eagle", model="org/draft", revision=None)
    assert identity_from_vllm(vllm_config, kv_cache_config).speculative == "eagle:org/draft:"


def test_pipeline_stages_and_scheduler_share_the_key_fingerprint() -> None:
    """Each stage (and the scheduler, given stage 0's config) sees its own layer count."""
    full = KVGroup(kind=GroupKind.FULL, block_size=32, num_layers=3)
    swa = KVGroup(kind=GroupKind.SLIDING_WINDOW, block_size=32, sliding_window=64, num_layers=2)
    stage0 = KVLayout(model="m", groups=[full, swa], pp_size=2)
    stage1 = stage0.model_copy(update={"groups": [full.model_copy(update={"num_layers": 1}), swa]})
    identity = KVIdentity()
    assert key_fingerprint(stage0, identity) == key_fingerprint(stage1, identity)
    # Another split of the layers over the stages is another deployment.
    split = identity.model_copy(update={"pp_layer_partition": "3,1"})
    assert key_fingerprint(stage0, split) != key_fingerprint(stage0, identity)


def test_the_info_metric_carries_every_input_and_says_why_two_deployments_differ() -> None:
    """``vllm:kvpool_key_fingerprint_info`` has one label per input of the fingerprint."""
    pytest.importorskip("vllm")
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvpool.connector.contract import metric_names as m
    from kvpool.connector.observability.vllm_metrics import (
        PoolConnectorStats,
        PoolPromMetrics,
        fingerprint_info_key,
    )

    base, other = KVIdentity(), KVIdentity(model_revision="v2")
    assert list(m.FINGERPRINT_LABELS) == list(fingerprint_inputs(LAYOUT, base))

    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = PoolPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        types,
        ["model_name", "engine"],
        {0: ["m", "0"], 1: ["m", "1"]},
    )
    for engine, identity in enumerate((base, other)):
        stats = PoolConnectorStats(
            data={"gauges": {fingerprint_info_key(fingerprint_inputs(LAYOUT, identity)): 1.0}}
        )
        prom.observe(PoolConnectorStats().aggregate(stats).data, engine)
    rows = [
        s.labels
        for metric in registry.collect()
        if metric.name == m.KEY_FINGERPRINT_INFO.name
        for s in metric.samples
        if s.value == 1.0
    ]
    assert len(rows) == 2
    differing = {name for name in m.FINGERPRINT_LABELS if rows[0][name] != rows[1][name]}
    assert differing == {"fingerprint", "model_revision"}  # why engine 1 does not share with engine 0
    assert {r["fingerprint"] for r in rows} == {key_fingerprint(LAYOUT, base), key_fingerprint(LAYOUT, other)}
