"""Tiny hybrid (sliding window + full attention) models for real-engine tests.

Each builder writes a Hugging Face model directory (``config.json``, random
weights with a fixed seed as ``model.safetensors``, ``generation_config.json``)
that vLLM loads offline with ``skip_tokenizer_init=True``. Builders are
idempotent: a directory whose stamp matches the requested spec is left alone.

torch and transformers are imported lazily, inside the builders.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Literal

Size = Literal["tiny", "large"]

STAMP_FILE = "kvpool_tiny_model.json"
"""File holding the spec a directory was built from (the idempotence key)."""

#: Gemma3 text sizes. ``tiny`` runs in a second on a laptop CPU; ``large`` is
#: about 0.3 B parameters, for benchmarks.
GEMMA3_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "sliding_window": 64,
    },
    "large": {
        "vocab_size": 32768,
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 18,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "sliding_window": 512,
    },
}

#: gpt-oss sizes (alternating sliding/full attention, MoE MLP, attention sinks).
GPT_OSS_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "sliding_window": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "large": {
        "vocab_size": 32768,
        "hidden_size": 1024,
        "intermediate_size": 1024,
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "sliding_window": 512,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
}

#: Initialiser std. Larger than the HF default (0.02) so that greedy outputs
#: depend strongly on the context: a corrupted KV block changes the tokens.
INIT_STD = 0.1

BOS_ID, EOS_ID, PAD_ID = 2, 1, 0


def _stamp(family: str, size: str, seed: int, dtype: str, config: dict[str, Any]) -> dict:
    body = {"family": family, "size": size, "seed": seed, "dtype": dtype, "config": config}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    return {**body, "sha256": digest}


def _is_built(path: Path, stamp: dict[str, Any]) -> bool:
    try:
        old = json.loads((path / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    return old.get("sha256") == stamp["sha256"] and (path / "model.safetensors").is_file()


def _save(model: Any, path: Path, stamp: dict[str, Any], dtype: str) -> None:
    """Save ``model`` atomically-ish: build in a sibling temp dir, then swap."""
    import torch

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.save_pretrained(str(tmp), safe_serialization=True)
    gen = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "do_sample": False}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2, sort_keys=True))
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)


def _init_weights(model: Any, seed: int) -> None:
    """Deterministic N(0, INIT_STD) weights; norms at 1 (their HF init)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name and p.dim() == 1:
                # Gemma RMSNorm uses (1 + w): zero keeps scale 1; gpt-oss uses w.
                p.fill_(0.0 if model.config.model_type.startswith("gemma") else 1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * INIT_STD)


def gemma3_config(size: Size = "tiny", **overrides: Any) -> dict[str, Any]:
    """Gemma3 text config dict: layers ``[sliding, sliding, full] * n``."""
    base = dict(GEMMA3_SIZES[size])
    base.update(overrides)
    n = base["num_hidden_layers"]
    pattern = ["sliding_attention", "sliding_attention", "full_attention"]
    base.setdefault("layer_types", [pattern[i % 3] for i in range(n)])
    base.setdefault("query_pre_attn_scalar", base["head_dim"])
    base.setdefault("max_position_embeddings", 4096)
    base.update(
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
        architectures=["Gemma3ForCausalLM"],
    )
    return base


def build_gemma3(
    path: str | os.PathLike[str],
    size: Size = "tiny",
    *,
    seed: int = 0,
    dtype: str = "float32",
    **overrides: Any,
) -> Path:
    """Build (or reuse) a random Gemma3 text model (``Gemma3ForCausalLM``) in ``path``."""
    cfg = gemma3_config(size, **overrides)
    return _build("gemma3", Path(path), size, seed, dtype, cfg, "Gemma3TextConfig", "Gemma3ForCausalLM")


def _build(
    family: str,
    path: Path,
    size: Size,
    seed: int,
    dtype: str,
    cfg: dict[str, Any],
    config_class: str,
    model_class: str,
) -> Path:
    """Random weights for transformers' ``model_class`` under ``cfg``, unless already built."""
    stamp = _stamp(family, size, seed, dtype, cfg)
    if _is_built(path, stamp):
        return path
    import torch
    import transformers

    config = getattr(transformers, config_class)(**cfg)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = getattr(transformers, model_class)(config)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    _init_weights(model, seed)
    _save(model, path, stamp, dtype)
    return path


def gpt_oss_config(size: Size = "tiny", **overrides: Any) -> dict[str, Any]:
    """gpt-oss config dict: layers alternate ``sliding, full``; unquantized MoE."""
    base = dict(GPT_OSS_SIZES[size])
    base.update(overrides)
    n = base["num_hidden_layers"]
    base.setdefault(
        "layer_types",
        ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
    )
    base.setdefault("max_position_embeddings", 4096)
    base.setdefault(
        "rope_parameters",
        {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    )
    base.update(
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
        architectures=["GptOssForCausalLM"],
    )
    return base


def build_gpt_oss(
    path: str | os.PathLike[str],
    size: Size = "tiny",
    *,
    seed: int = 0,
    dtype: str = "bfloat16",
    **overrides: Any,
) -> Path:
    """Build (or reuse) a random unquantized gpt-oss model in ``path``."""
    cfg = gpt_oss_config(size, **overrides)
    return _build("gpt_oss", Path(path), size, seed, dtype, cfg, "GptOssConfig", "GptOssForCausalLM")


BUILDERS = {"gemma3": build_gemma3, "gpt_oss": build_gpt_oss}


def build(family: str, path: str | os.PathLike[str], size: Size = "tiny", **kw: Any) -> Path:
    """Build a model of ``family`` (``gemma3`` or ``gpt_oss``) into ``path``."""
    return BUILDERS[family](path, size, **kw)
