"""The hybrid hit over a whole presence set: the oracle the asking lookup is checked against.

``HybridHitCoordinator.find_hit_asking`` asks the pool only about the blocks vLLM's fixed
point reads; its hit must equal the fixed point over everything the pool holds, which
:func:`find_hit` computes here from a presence set given up front: every block
answered before the fixed point runs, nothing asked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvpool.connector.scheduler.hybrid_hit import AskingBlockPool, HybridHit, HybridHitCoordinator


def find_hit_indexed(
    coord: HybridHitCoordinator,
    block_hashes: Sequence[Any],
    present: Mapping[int, Mapping[bytes, int]],
    max_hit_tokens: int,
) -> HybridHit:
    """The hit, given per group each present block's hash (at the group's block size, as
    ``lookup_blocks`` names it) mapped to the block's index."""
    held = {group_id: dict.fromkeys(index.values(), True) for group_id, index in present.items()}
    pool = AskingBlockPool(coord.hash_block_size, present, held, assume_present=False)
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
