"""The hybrid hit over a whole presence set: the oracle the asking lookup is checked against.

``HybridHitCoordinator.find_hit_asking`` asks the pool only about the blocks vLLM's fixed
point reads; its hit must equal the fixed point over everything the pool holds, which
:func:`find_hit` computes here from a presence set given up front (no asking).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from kvpool.connector.scheduler.hybrid_hit import HybridHit, HybridHitCoordinator


class PresenceBlockPool:
    """Duck-typed ``BlockPool``: ``get_cached_block`` answers from a presence index.

    Each group's block hashes (viewed at the group's block size) map to the block's
    index; a cached "block" is a marker whose ``block_id`` is that index.
    """

    def __init__(self, hash_block_size: int, present: Mapping[int, Mapping[bytes, int]]):
        self.hash_block_size = hash_block_size
        self.null_block = KVCacheBlock(block_id=-1, is_null=True)
        self._present = present

    def get_cached_block(
        self, block_hash: Any, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        key = block_hash if type(block_hash) is bytes else bytes(block_hash)
        blocks: list[KVCacheBlock] = []
        for group_id in kv_cache_group_ids:
            index = self._present.get(group_id, {}).get(key)
            if index is None:
                return None
            blocks.append(KVCacheBlock(block_id=index))
        return blocks


def find_hit_indexed(
    coord: HybridHitCoordinator,
    block_hashes: Sequence[Any],
    present: Mapping[int, Mapping[bytes, int]],
    max_hit_tokens: int,
) -> HybridHit:
    """The hit, given per group each present block's hash (at the group's block size, as
    ``lookup_blocks`` names it) mapped to the block's index."""
    pool = PresenceBlockPool(coord.hash_block_size, present)
    return coord.hit_over(block_hashes, pool, max_hit_tokens, pool)


def find_hit(
    coord: HybridHitCoordinator,
    block_hashes: Sequence[Any],
    present: dict[int, set[bytes]],
    max_hit_tokens: int,
) -> HybridHit:
    """Longest hit <= ``max_hit_tokens`` every group can serve from ``present``."""
    index: dict[int, dict[bytes, int]] = {}
    for group_id, hashes in present.items():
        view = coord.group_block_hashes(group_id, block_hashes)
        index[group_id] = {h: i for i in range(len(view)) if (h := bytes(view[i])) in hashes}
    return find_hit_indexed(coord, block_hashes, index, max_hit_tokens)
