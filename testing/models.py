"""Random-weight models for the tests and benchmarks: the demo's tiny hybrid Gemma3
(:func:`build_gemma3`, from :mod:`kvpool.connector.local.tiny_model`), an all-full-attention
Gemma3 (and one with a single KV head), a larger Gemma3, gpt-oss.

Built with :func:`kvpool.connector.local.tiny_model.build_random_model`, so they
are idempotent and deterministic in the same way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from kvpool.connector.local.tiny_model import SPECIAL_TOKENS, STAMP_FILE, build_gemma3, build_random_model

__all__ = [
    "GEMMA3_FULL_LAYERS",
    "GEMMA3_LARGE",
    "STAMP_FILE",
    "build_gemma3",
    "build_gemma3_full",
    "build_gemma3_one_kv_head",
    "build_gemma3_window_only",
    "build_gpt_oss",
    "gpt_oss_config",
]

#: Layers of :func:`build_gemma3_full`: all full attention, so one KV-cache group.
GEMMA3_FULL_LAYERS = 6


def build_gemma3_full(path: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """The tiny Gemma3 with full attention in every layer: one KV-cache group, so pool loads
    run synchronously before the forward and a failed block comes back to vLLM by block id.

    Weights N(0, 0.1) and untied embeddings, like every tiny model here: one wrong KV block
    among ten changes the greedy tokens and their log-probabilities (a weakly initialised
    model, std 0.02 and tied embeddings, hides such damage).
    """
    return build_gemma3(
        path,
        seed=seed,
        num_hidden_layers=GEMMA3_FULL_LAYERS,
        layer_types=["full_attention"] * GEMMA3_FULL_LAYERS,
    )


def build_gemma3_window_only(path: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """The tiny Gemma3 with a 64-token sliding window in every layer: one KV-cache group,
    whose hit leaves every block below its window a null block."""
    return build_gemma3(
        path,
        seed=seed,
        num_hidden_layers=GEMMA3_FULL_LAYERS,
        layer_types=["sliding_attention"] * GEMMA3_FULL_LAYERS,
    )


def build_gemma3_one_kv_head(path: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """The all-full-attention tiny Gemma3 with one KV head (four query heads): at TP=2 vLLM
    gives both ranks a copy of that head, so the ranks hold the same KV (one shard)."""
    return build_gemma3(
        path,
        seed=seed,
        num_hidden_layers=GEMMA3_FULL_LAYERS,
        num_key_value_heads=1,
        layer_types=["full_attention"] * GEMMA3_FULL_LAYERS,
    )


#: Gemma3 overrides for about 0.3 B parameters (benchmarks): ``build_gemma3(path, **GEMMA3_LARGE)``.
GEMMA3_LARGE: dict[str, Any] = {
    "vocab_size": 32768,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 18,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "sliding_window": 512,
    "max_position_embeddings": 8448,  # the TTFT benchmark's 8k-token prefix
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


def gpt_oss_config(size: Literal["tiny", "large"] = "tiny", **overrides: Any) -> dict[str, Any]:
    """gpt-oss config dict: layers alternate ``sliding, full``; unquantized MoE."""
    base = {**GPT_OSS_SIZES[size], **overrides}
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
    base.update(SPECIAL_TOKENS, tie_word_embeddings=False, architectures=["GptOssForCausalLM"])
    return base


def build_gpt_oss(
    path: str | os.PathLike[str],
    size: Literal["tiny", "large"] = "tiny",
    *,
    seed: int = 0,
    dtype: str = "bfloat16",
    **overrides: Any,
) -> Path:
    """Build (or reuse) a random unquantized gpt-oss model in ``path``."""
    config = gpt_oss_config(size, **overrides)
    return build_random_model(
        path, "gpt_oss", config, "GptOssConfig", "GptOssForCausalLM", seed=seed, dtype=dtype
    )
