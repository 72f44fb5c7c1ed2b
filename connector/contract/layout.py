"""The KV-layout contract shared by the connector and the operator.

A plain description of the KV cache a model produces (no vLLM, no torch), the
rules the connector can serve (``check``), and the layout fingerprint that goes
into every store key so incompatible layouts never read each other's blocks.
"""

from __future__ import annotations

import hashlib
import json
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class GroupKind(StrEnum):
    """The attention kind of one KV-cache group."""

    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL = "chunked_local"
    MAMBA = "mamba"
    CROSS = "cross"


MambaCacheMode = Literal["none", "align", "all"]


class KVGroup(BaseModel):
    """One KV-cache group: layers that share a spec and a block table."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: GroupKind = Field(description="Attention kind of the group's layers.")
    block_size: int = Field(gt=0, description="Tokens per KV block of this group.")
    sliding_window: int | None = Field(
        default=None, gt=0, description="Window in tokens (sliding_window groups)."
    )
    attention_chunk_size: int | None = Field(
        default=None, gt=0, description="Chunk in tokens (chunked_local groups)."
    )
    mamba_cache_mode: MambaCacheMode | None = Field(
        default=None, description="vLLM's mamba_cache_mode (mamba groups)."
    )
    num_layers: int = Field(default=1, ge=1, description="Layers in the group.")
    page_size_bytes: int | None = Field(
        default=None, gt=0, description="Bytes of one block of one layer, when known."
    )
    prefix_cacheable: bool = Field(
        default=True, description="Whether vLLM may share this group's blocks by prefix."
    )
    eagle: bool = Field(default=False, description="An EAGLE/MTP draft group.")


class KVLayout(BaseModel):
    """The KV-cache layout of one model deployment."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(default="", description="Model identity (name or path).")
    dtype: str = Field(default="auto", description="KV-cache dtype.")
    groups: list[KVGroup] = Field(min_length=1, description="KV-cache groups, in vLLM's order.")
    hash_block_size: int | None = Field(
        default=None, gt=0, description="Tokens per prefix hash; defaults to the cache block size."
    )
    cache_block_size: int | None = Field(
        default=None, gt=0, description="vLLM's cache_config.block_size (attention block)."
    )
    tp_size: int = Field(default=1, ge=1)
    pp_size: int = Field(default=1, ge=1)
    pcp_size: int = Field(default=1, ge=1)
    dcp_size: int = Field(default=1, ge=1)
    kv_shards: int | None = Field(
        default=None,
        ge=1,
        description="Distinct KV shards of the attention groups over the tensor-parallel ranks: "
        "min(tp_size, total KV heads), 1 with MLA; ranks beyond it hold copies. "
        "None: one per rank (tp_size). Mamba and EAGLE groups are always one per rank.",
    )

    @property
    def recovers_failed_loads_by_block(self) -> bool:
        """Whether a failed load may go back to vLLM block by block (it then recomputes from
        the first failed block): only with one full-attention group, where every block below
        a hit is real. A window, chunk or Mamba group holds null blocks below its hit, which
        a recompute from inside the hit would read; such layouts, and hybrids, send the
        request back whole."""
        return len(self.groups) == 1 and self.groups[0].kind == GroupKind.FULL

    @property
    def effective_hash_block_size(self) -> int:
        """Hash granularity: explicit, else the cache block size, else the smallest block."""
        if self.hash_block_size is not None:
            return self.hash_block_size
        if self.cache_block_size is not None:
            return self.cache_block_size
        return min(g.block_size for g in self.groups)


class Problem(BaseModel):
    """One reason a layout (or settings) cannot be served."""

    model_config = ConfigDict(frozen=True)

    field: str = Field(description="Path of the offending field, e.g. groups[1].kind.")
    rule: str = Field(description="Stable identifier of the broken rule.")
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message} [{self.rule}]"


def check(layout: KVLayout) -> list[Problem]:
    """Every reason the connector cannot serve ``layout``; empty when it can."""
    problems: list[Problem] = []
    hash_block = layout.effective_hash_block_size
    for index, group in enumerate(layout.groups):
        problems.extend(_check_group(index, group, layout, hash_block))
    if len(layout.groups) > 1 and layout.dcp_size > 1:
        problems.append(
            Problem(
                field="dcp_size",
                rule="hybrid-context-parallel",
                message=(
                    f"dcp_size={layout.dcp_size} with {len(layout.groups)} KV-cache groups: "
                    "hybrid layouts are not supported with decode context parallelism > 1"
                ),
            )
        )
    if layout.pcp_size > 1:
        problems.append(
            Problem(
                field="pcp_size",
                rule="prefill-context-parallel",
                message=(
                    f"pcp_size={layout.pcp_size}: prefill context parallel ranks hold different "
                    "tokens of one block under the same tensor rank, and store keys name only "
                    "tensor and pipeline ranks"
                ),
            )
        )
    problems.extend(_check_kv_shards(layout))
    if not any(g.prefix_cacheable and g.kind != GroupKind.CROSS for g in layout.groups):
        problems.append(
            Problem(
                field="groups",
                rule="no-cacheable-group",
                message="no prefix-cacheable KV-cache group: nothing could ever hit",
            )
        )
    return problems


def _check_kv_shards(layout: KVLayout) -> list[Problem]:
    shards = layout.kv_shards
    if shards is None or shards == layout.tp_size:
        return []
    if layout.tp_size % shards != 0:
        return [
            Problem(
                field="kv_shards",
                rule="kv-shards-divide-tp",
                message=f"kv_shards={shards} does not divide tp_size={layout.tp_size}: "
                "each shard is held by the same number of tensor-parallel ranks",
            )
        ]
    if layout.pcp_size > 1 or layout.dcp_size > 1:
        return [
            Problem(
                field="kv_shards",
                rule="kv-shards-context-parallel",
                message=f"kv_shards={shards} below tp_size={layout.tp_size} with pcp_size="
                f"{layout.pcp_size}, dcp_size={layout.dcp_size}: context parallelism splits "
                "tokens over the ranks that hold a head, so their KV is not one shard",
            )
        ]
    return []


def _check_group(index: int, group: KVGroup, layout: KVLayout, hash_block: int) -> list[Problem]:
    where = f"groups[{index}]"
    problems: list[Problem] = []

    def add(field: str, rule: str, message: str) -> None:
        problems.append(Problem(field=f"{where}.{field}", rule=rule, message=message))

    if group.kind == GroupKind.CROSS:
        add("kind", "cross-attention", f"group {index} is cross attention, which is unsupported")
    if group.kind == GroupKind.SLIDING_WINDOW and group.sliding_window is None:
        add("sliding_window", "window-required", f"group {index} is sliding_window without a window")
    if group.kind == GroupKind.CHUNKED_LOCAL and group.attention_chunk_size is None:
        add(
            "attention_chunk_size",
            "chunk-required",
            f"group {index} is chunked_local without an attention_chunk_size",
        )
    if group.kind == GroupKind.MAMBA:
        if group.mamba_cache_mode != "align":
            add(
                "mamba_cache_mode",
                "mamba-align",
                f"group {index} is mamba with mamba_cache_mode={group.mamba_cache_mode!r}; "
                "only 'align' keeps per-block states the pool can share",
            )
        if layout.cache_block_size is not None and group.block_size != layout.cache_block_size:
            add(
                "block_size",
                "mamba-block-size",
                f"group {index} is mamba with block_size={group.block_size}; 'align' mode "
                f"needs it equal to the cache block size {layout.cache_block_size}",
            )
    if group.prefix_cacheable and group.block_size % hash_block != 0:
        add(
            "block_size",
            "hash-block-divisible",
            f"group {index} block_size={group.block_size} is not divisible by the "
            f"hash block size {hash_block}",
        )
    return problems


def check_or_raise(layout: KVLayout) -> None:
    """Raise one ``ValueError`` listing every problem of ``layout``."""
    problems = check(layout)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(f"KV layout not supported by KVPoolConnector:\n{lines}")


def canonical_payload(layout: KVLayout) -> dict[str, Any]:
    """The layout as the fingerprint sees it: the hash block size resolved, and ``kv_shards``
    only when ranks hold copies (one shard per rank is the layout without it)."""
    payload = layout.model_dump(mode="json")
    payload["hash_block_size"] = layout.effective_hash_block_size
    if layout.kv_shards in (None, layout.tp_size):
        del payload["kv_shards"]
    return payload


def fingerprint(layout: KVLayout) -> str:
    """A short stable digest of everything that makes KV bytes interchangeable."""
    canonical = json.dumps(canonical_payload(layout), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
