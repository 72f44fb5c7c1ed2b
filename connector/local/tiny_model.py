"""A tiny hybrid Gemma3 (sliding-window and full attention) with random weights.

:func:`build_gemma3` writes a Hugging Face model directory (``config.json``,
fixed-seed random weights as ``model.safetensors``, ``generation_config.json``)
that vLLM loads offline with ``skip_tokenizer_init=True``. It runs in about a
second on a laptop CPU. :func:`build_random_model` does the same for any
transformers architecture. Builds are idempotent: a directory whose stamp
matches the requested build is left alone.

torch and transformers are imported lazily, inside the builders.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

STAMP_FILE = "kvpool_tiny_model.json"
"""File holding the build a directory was made from (the idempotence key)."""

#: The tiny Gemma3 text model: six layers, ``[sliding, sliding, full] * 2``.
GEMMA3_TINY: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "sliding_window": 64,
}

#: Initialiser std. Larger than the HF default (0.02) so that greedy outputs
#: depend strongly on the context: a corrupted KV block changes the tokens.
INIT_STD = 0.1

BOS_ID, EOS_ID, PAD_ID = 2, 1, 0

#: Token ids every tiny model's config names (random weights, no tokenizer).
SPECIAL_TOKENS = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}


def gemma3_config(**overrides: Any) -> dict[str, Any]:
    """Gemma3 text config: :data:`GEMMA3_TINY` with ``overrides``; layers ``[sliding, sliding, full] * n``."""
    base = {**GEMMA3_TINY, **overrides}
    n = base["num_hidden_layers"]
    pattern = ["sliding_attention", "sliding_attention", "full_attention"]
    base.setdefault("layer_types", [pattern[i % 3] for i in range(n)])
    base.setdefault("query_pre_attn_scalar", base["head_dim"])
    base.setdefault("max_position_embeddings", 4096)
    base.update(SPECIAL_TOKENS, tie_word_embeddings=False, architectures=["Gemma3ForCausalLM"])
    return base


def build_gemma3(
    path: str | os.PathLike[str], *, seed: int = 0, dtype: str = "float32", **overrides: Any
) -> Path:
    """Build (or reuse) a random Gemma3 text model (``Gemma3ForCausalLM``) in ``path``."""
    config = gemma3_config(**overrides)
    return build_random_model(
        path, "gemma3", config, "Gemma3TextConfig", "Gemma3ForCausalLM", seed=seed, dtype=dtype
    )


def build_random_model(
    path: str | os.PathLike[str],
    family: str,
    config: dict[str, Any],
    config_class: str,
    model_class: str,
    *,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Random weights for transformers' ``model_class`` under ``config`` in ``path``, unless built."""
    path = Path(path)
    stamp = _stamp(family, seed, dtype, config)
    if _is_built(path, stamp):
        return path
    import torch
    import transformers

    hf_config = getattr(transformers, config_class)(**config)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = getattr(transformers, model_class)(hf_config)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    _init_weights(model, seed)
    _save(model, path, stamp, dtype)
    return path


def _stamp(family: str, seed: int, dtype: str, config: dict[str, Any]) -> dict[str, Any]:
    body = {"family": family, "seed": seed, "dtype": dtype, "config": config}
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
    generation = {**SPECIAL_TOKENS, "do_sample": False}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
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
                # Gemma RMSNorm uses (1 + w): zero keeps scale 1; others use w.
                p.fill_(0.0 if model.config.model_type.startswith("gemma") else 1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * INIT_STD)
