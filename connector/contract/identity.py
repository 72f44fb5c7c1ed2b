"""What, beyond the layout's shape, makes two deployments' KV blocks interchangeable.

The :class:`~kvpool.connector.contract.layout.KVLayout` describes the shape of
the cache (groups, block sizes, parallelism). Two deployments with the same
shape may still compute different bytes for the same tokens (another cache
dtype, another revision of the weights, another quantization) or different
block hashes for the same prompt (another hash algorithm or seed). The
:class:`KVIdentity` names those inputs; :func:`key_fingerprint` digests shape
and identity together into the fingerprint every store key carries, so
deployments that differ in any of them never read each other's blocks.

No vLLM, no torch: the operator and dashboards may import it.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, ConfigDict, Field

from kvpool.connector.contract.layout import KVLayout, fingerprint
from kvpool.connector.contract.shards import shard_independent

#: vLLM's block-hash algorithms that are not collision resistant (fast, and seeded by PYTHONHASHSEED).
NON_CRYPTOGRAPHIC_BLOCK_HASHES = frozenset({"xxhash", "xxhash_cbor"})


def refuse_weak_block_hash(algorithm: str, allowed: bool) -> None:
    """Raise when the block hash is not collision resistant and the pool does not allow it: one
    engine computing a crafted prompt would store its KV under another prompt's key, and every
    engine sharing that prefix would load it."""
    if algorithm in NON_CRYPTOGRAPHIC_BLOCK_HASHES and not allowed:
        raise ValueError(
            f"KVPoolConnector: prefix_caching_hash_algo={algorithm} is not collision resistant; in a "
            "shared pool a crafted prompt could place its KV under another prompt's key for every "
            "engine. Use sha256 (vLLM's default) or sha256_cbor, or set "
            "allow_non_cryptographic_block_hash: true in kv_connector_extra_config (a pool's "
            "spec.connector) to accept that risk."
        )


def seed_digest(seed: str) -> str:
    """A short digest of the block-hash seed: identifies it without revealing it."""
    return hashlib.sha256(seed.encode()).hexdigest()[:12]


class KVIdentity(BaseModel):
    """The non-shape inputs of the key fingerprint (see the table in docs/architecture.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cache_dtype: str = Field(
        default="auto", description="vLLM's --kv-cache-dtype by name (fp8_e4m3 != fp8_e5m2)."
    )
    kv_quantization: str = Field(
        default="none",
        description="How KV is quantized beyond the dtype: layers skipped from quantization, "
        "Mamba state dtypes.",
    )
    model_revision: str = Field(default="", description="The model's revision (branch, tag or commit).")
    weight_quantization: str = Field(default="", description="The weights' quantization method, if any.")
    hf_overrides: str = Field(default="", description="Digest of the hf_overrides that change the model.")
    kv_cache_layout: str = Field(default="", description="vLLM's resolved KV cache memory layout.")
    block_hash_algorithm: str = Field(default="sha256", description="vLLM's prefix_caching_hash_algo.")
    pp_layer_partition: str = Field(
        default="", description="vLLM's VLLM_PP_LAYER_PARTITION (empty: vLLM's even split)."
    )
    block_hash_seed: str = Field(
        default="", description="Digest of the seed of vLLM's block hashes (PYTHONHASHSEED or the default)."
    )
    vllm_version: str = Field(default="", description="vLLM's version: its kernels write the blocks.")
    model_dtype: str = Field(default="", description="The model's dtype (what a quantized cache quantizes).")
    model_settings: str = Field(
        default="",
        description="Digest of model settings beyond name and revision: config path, code revision, "
        "weights path, online quantization, the RoPE variant max_model_len picks.",
    )
    attention_kernel: str = Field(
        default="", description="Device type, chosen attention backend, and on the CPU each group's ISA."
    )
    speculative: str = Field(default="", description="The speculative drafter: method, model, revision.")


def stage_independent(layout: KVLayout) -> KVLayout:
    """``layout`` as every pipeline stage and the scheduler describe it alike.

    Each process sees only its own stage's layers (vLLM hands the scheduler
    stage 0's config), so a group's layer count differs between processes of
    one deployment; keys name the pipeline rank, and the stage split is part of
    the identity (``pp_layer_partition``), so the count is left out.
    """
    return layout.model_copy(
        update={"groups": [g.model_copy(update={"num_layers": 1}) for g in layout.groups]}
    )


def key_fingerprint(layout: KVLayout, identity: KVIdentity) -> str:
    """The fingerprint in every store key: the layout's shape and the identity together.

    Layouts whose keys name KV shards leave the tensor size out for the shard count
    (:func:`~kvpool.connector.contract.shards.shard_independent`).
    """
    shape = stage_independent(shard_independent(layout))
    payload = {"layout": fingerprint(shape), "identity": identity.model_dump(mode="json")}
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def fingerprint_inputs(layout: KVLayout, identity: KVIdentity) -> dict[str, str]:
    """Every input of the key fingerprint as flat strings, for the start-up log and the info metric."""
    return {
        "fingerprint": key_fingerprint(layout, identity),
        "layout_fingerprint": fingerprint(layout),
        "model": layout.model,
        "dtype": layout.dtype,
        "groups": ",".join(f"{g.kind.value}:{g.block_size}" for g in layout.groups),
        "hash_block_size": str(layout.effective_hash_block_size),
        "parallel": f"tp{layout.tp_size}{_copies(layout)}-pp{layout.pp_size}-pcp{layout.pcp_size}"
        f"-dcp{layout.dcp_size}",
        **{name: str(value) for name, value in identity.model_dump(mode="json").items()},
    }


def _copies(layout: KVLayout) -> str:
    """``-kv<shards>`` when tensor ranks hold copies of the attention KV, else nothing."""
    shards = layout.kv_shards
    return "" if shards in (None, layout.tp_size) else f"-kv{shards}"
