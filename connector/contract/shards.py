"""Tensor shards: which tensor-parallel ranks hold the same KV, and who stores it.

Tensor parallelism splits attention KV by KV head. When the ranks outnumber the
model's KV heads, vLLM replicates each head over ``tp_size // total_kv_heads``
consecutive ranks (rank ``r`` holds head ``r // (tp_size // total_kv_heads)``);
with MLA every rank holds the same latent KV. Such ranks hold identical bytes,
so a block of such a group is one object per *shard*, not per rank: the lowest
rank of a shard writes it, every rank of the shard reads it, and a hit needs one
object per shard. Mamba states are split by the SSM's heads, and an EAGLE
draft's KV by its own heads: those groups stay one object per rank.

One source for the scheduler's lookups, the workers' keys, the KV events and
the operator's validation. No vLLM, no torch.
"""

from __future__ import annotations

from kvpool.connector.contract.layout import GroupKind, KVGroup, KVLayout


def kv_shards_of(tp_size: int, total_kv_heads: int, use_mla: bool) -> int:
    """The distinct KV shards of attention groups over ``tp_size`` ranks (1 with MLA)."""
    if use_mla:
        return 1
    return max(1, min(tp_size, total_kv_heads))


def named_by_shard(group: KVGroup) -> bool:
    """Whether ``group``'s keys name its KV shard (attention) rather than the tensor rank."""
    return group.kind != GroupKind.MAMBA and not group.eagle


def group_shards(layout: KVLayout) -> tuple[int, ...]:
    """Per group: the objects one block is stored as on one pipeline stage."""
    attention = layout.kv_shards or layout.tp_size
    return tuple(attention if named_by_shard(g) else layout.tp_size for g in layout.groups)


def shard_of(tp_rank: int, tp_size: int, shards: int) -> int:
    """The shard tensor rank ``tp_rank`` holds, when ``tp_size`` ranks hold ``shards`` shards."""
    return tp_rank // (tp_size // shards)


def writes_shard(tp_rank: int, tp_size: int, shards: int) -> bool:
    """Whether ``tp_rank`` is the lowest rank of its shard: the one that stores it."""
    return tp_rank % (tp_size // shards) == 0


def shard_independent(layout: KVLayout) -> KVLayout:
    """``layout`` as deployments with the same shard split describe it alike.

    When every group's keys name its shard, a shard's bytes (the per-rank page
    size is part of each group) do not depend on how many ranks hold a copy:
    the tensor size is replaced by the shard count, so a one-KV-head model at
    TP=1 and TP=2 (or two KV heads at TP=2 and TP=4) share keys. A layout with
    a per-rank group keeps its tensor size.
    """
    if layout.kv_shards is None or not all(named_by_shard(g) for g in layout.groups):
        return layout
    return layout.model_copy(update={"tp_size": layout.kv_shards, "kv_shards": None})
