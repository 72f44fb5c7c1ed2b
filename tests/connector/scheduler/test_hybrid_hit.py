"""Differential: the external coordinator vs vLLM's real HybridKVCacheCoordinator.

For random hybrid layouts and random pool contents, our fixed point over a
presence set must give exactly the hit vLLM's coordinator finds over a real
``BlockPool`` holding the same blocks, and the per-group load masks must name
exactly the real (non-null) blocks vLLM's hit uses.
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.utils.math_utils import cdiv

from kvpool.connector.scheduler.hybrid_hit import HybridHitCoordinator
from testing.hit_oracle import find_hit
from testing.kv_cache import GroupDesc, block_sizes, fill_block_pool, make_coordinator

EXAMPLES = int(os.environ.get("KVPOOL_HYPOTHESIS_EXAMPLES", "150"))

BASE = 32  # vLLM CPU needs block sizes in multiples of 32


@st.composite
def layouts(draw: st.DrawFn) -> list[GroupDesc]:
    n = draw(st.integers(1, 4))
    groups = []
    for _ in range(n):
        kind = draw(st.sampled_from(["full", "sliding_window", "mamba"]))
        block = BASE * draw(st.sampled_from([1, 1, 2]))
        window = draw(st.sampled_from([16, 33, 64, 100, 128, 256])) if kind == "sliding_window" else 0
        groups.append(GroupDesc(kind, block, window))
    if all(g.kind == "mamba" for g in groups) and n == 1:
        groups[0] = GroupDesc("full", groups[0].block_size)
    if any(g.kind == "mamba" for g in groups):
        # Mamba 'align' keeps one block size across the model.
        groups = [GroupDesc(g.kind, BASE, g.window) for g in groups]
    if draw(st.booleans()):
        eagle_at = draw(st.integers(0, len(groups) - 1))
        if groups[eagle_at].kind != "mamba":
            g = groups[eagle_at]
            groups[eagle_at] = GroupDesc(g.kind, g.block_size, g.window, eagle=True)
    return groups


def _presence(
    draw: st.DrawFn, coordinator, ours: HybridHitCoordinator, block_hashes
) -> dict[int, set[bytes]]:
    present: dict[int, set[bytes]] = {}
    for group in ours.groups:
        view = ours.group_block_hashes(group.group_id, block_hashes)
        n = len(view)
        prefix = draw(st.integers(0, n))
        holes = draw(st.sets(st.integers(0, max(n - 1, 0)), max_size=3)) if n else set()
        extra = draw(st.sets(st.integers(0, max(n - 1, 0)), max_size=3)) if n else set()
        indices = (set(range(prefix)) - holes) | extra
        present[group.group_id] = {bytes(view[i]) for i in indices if i < n}
    return present


def _drawn_case(
    groups: list[GroupDesc], data: st.DataObject
) -> tuple[Any, HybridHitCoordinator, list, dict, int]:
    """vLLM's coordinator over ``groups`` with a drawn prompt and presence in its block pool; ours
    from it; the prompt's hashes, the presence and the longest hit a lookup may grant."""
    coordinator = make_coordinator(groups)
    ours = HybridHitCoordinator.from_vllm_coordinator(coordinator)
    scheduler_block, hash_block = block_sizes(groups)
    num_tokens = data.draw(st.integers(1, 24 * scheduler_block), label="num_tokens")
    block_hashes = [os.urandom(32) for _ in range(num_tokens // hash_block)]
    present = _presence(data.draw, coordinator, ours, block_hashes)
    fill_block_pool(coordinator, present)
    return coordinator, ours, block_hashes, present, num_tokens - 1


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups=layouts(), data=st.data())
def test_same_hit_and_masks_as_vllm(groups: list[GroupDesc], data: st.DataObject) -> None:
    coordinator, ours, block_hashes, present, max_hit = _drawn_case(groups, data)
    scheduler_block = block_sizes(groups)[0]
    assert ours.scheduler_block_size == scheduler_block
    real_blocks, real_hit, _ = coordinator.find_longest_cache_hit(block_hashes, max_hit)

    # The connector only asks the pool about the blocks lookup_blocks names.
    asked = ours.lookup_blocks(block_hashes, max_hit)
    known = {g: present.get(g, set()) & set(asked.get(g, [])) for g in range(len(groups))}
    hit = find_hit(ours, block_hashes, known, max_hit)

    assert hit.hit_tokens == real_hit
    assert hit.hit_tokens % scheduler_block == 0
    if hasattr(coordinator, "find_longest_cache_hit_per_group"):
        _, alone = coordinator.find_longest_cache_hit_per_group(block_hashes, max_hit)
        assert hit.group_hit_tokens == tuple(alone)
    for group in ours.groups:
        gid = group.group_id
        limit = cdiv(real_hit, group.block_size)
        real_positions = [i for i, b in enumerate(real_blocks[gid][:limit]) if not b.is_null]
        if group.spec.__class__.__name__ == "MambaSpec":
            real_positions = real_positions[-1:]
        assert list(hit.needed_blocks[gid]) == real_positions, (gid, group.spec)
        # A mask never asks for more than the hit covers.
        assert all(i < limit for i in hit.needed_blocks[gid])


def test_sliding_window_needs_only_its_window() -> None:
    groups = [GroupDesc("full", 32), GroupDesc("sliding_window", 32, window=64)]
    coordinator = make_coordinator(groups)
    ours = HybridHitCoordinator.from_vllm_coordinator(coordinator)
    block_hashes = [os.urandom(32) for _ in range(20)]
    present = {g: {bytes(h) for h in block_hashes} for g in (0, 1)}
    hit = find_hit(ours, block_hashes, present, 20 * 32 - 1)
    assert hit.hit_tokens == 19 * 32
    assert hit.needed_blocks[0] == tuple(range(19))
    # A 64-token window at position 608 needs cdiv(63, 32) = 2 blocks: 17 and 18.
    assert hit.needed_blocks[1] == (17, 18)


def test_mamba_needs_only_last_state() -> None:
    groups = [GroupDesc("full", 32), GroupDesc("mamba", 32)]
    coordinator = make_coordinator(groups)
    ours = HybridHitCoordinator.from_vllm_coordinator(coordinator)
    block_hashes = [os.urandom(32) for _ in range(10)]
    present = {0: {bytes(h) for h in block_hashes}, 1: {bytes(h) for h in block_hashes[:6]}}
    hit = find_hit(ours, block_hashes, present, 10 * 32 - 1)
    assert hit.hit_tokens == 6 * 32
    assert hit.needed_blocks[0] == tuple(range(6))
    assert hit.needed_blocks[1] == (5,)


def test_group_that_lost_its_window_cuts_the_hit() -> None:
    groups = [GroupDesc("full", 32), GroupDesc("sliding_window", 32, window=64)]
    coordinator = make_coordinator(groups)
    ours = HybridHitCoordinator.from_vllm_coordinator(coordinator)
    block_hashes = [os.urandom(32) for _ in range(12)]
    # The window group lost blocks 6..11: its last usable window ends at block 5.
    present = {0: {bytes(h) for h in block_hashes}, 1: {bytes(h) for h in block_hashes[:6]}}
    hit = find_hit(ours, block_hashes, present, 12 * 32 - 1)
    assert hit.hit_tokens == 6 * 32
    # Full attention alone could have served 11 blocks; the hybrid hit threw 5 away.
    assert hit.group_hit_tokens == (11 * 32, 6 * 32)
    assert hit.needed_blocks[1] == (4, 5)


def _oracle(wanted: dict[int, list[bytes]], present: dict[int, set[bytes]], asked: list[int]):
    """An ``ask`` answering from ``present``; notes how many blocks each call asked about."""

    def ask(questions):
        for group_id, indices in questions.items():
            assert all(0 <= i < len(wanted[group_id]) for i in indices)
        asked.append(sum(len(indices) for indices in questions.values()))
        return {g: [wanted[g][i] in present.get(g, set()) for i in idx] for g, idx in questions.items()}

    return ask


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups=layouts(), data=st.data(), max_rounds=st.integers(1, 4))
def test_asking_only_what_the_fixed_point_reads_finds_vllms_hit(
    groups: list[GroupDesc], data: st.DataObject, max_rounds: int
) -> None:
    coordinator, ours, block_hashes, present, max_hit = _drawn_case(groups, data)
    real_blocks, real_hit, _ = coordinator.find_longest_cache_hit(block_hashes, max_hit)
    wanted = ours.lookup_blocks(block_hashes, max_hit)
    asked: list[int] = []
    hit, known = ours.find_hit_asking(
        block_hashes, wanted, max_hit, _oracle(wanted, present, asked), max_rounds=max_rounds
    )

    assert hit.hit_tokens == real_hit
    # Never asked about a block twice, and the answers kept are the pool's.
    assert sum(asked) == sum(len(k) for k in known.values())
    for g, held in known.items():
        assert all(ok == (wanted[g][i] in present.get(g, set())) for i, ok in held.items())
    for group in ours.groups:
        gid = group.group_id
        limit = cdiv(real_hit, group.block_size)
        real_positions = [i for i, b in enumerate(real_blocks[gid][:limit]) if not b.is_null]
        if group.spec.__class__.__name__ == "MambaSpec":
            real_positions = real_positions[-1:]
        assert list(hit.needed_blocks[gid]) == real_positions, (gid, group.spec)
    # A group's own hit, from what was asked, never claims more than the pool holds.
    full = find_hit(
        ours, block_hashes, {g: present.get(g, set()) & set(wanted.get(g, [])) for g in wanted}, max_hit
    )
    assert all(a <= b for a, b in zip(hit.group_hit_tokens, full.group_hit_tokens))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups=layouts(), data=st.data())
def test_a_remembered_first_round_asks_what_a_fresh_one_would(
    groups: list[GroupDesc], data: st.DataObject
) -> None:
    """A coordinator remembers each lookup shape's first questions (issue #32: vLLM's managers
    ran again for every request): a second request of the same length, with other hashes and
    other pool contents, is asked the first questions a fresh coordinator asks, and its hit
    is still vLLM's."""
    _, ours, block_hashes, present, max_hit = _drawn_case(groups, data)
    first_wanted = ours.lookup_blocks(block_hashes, max_hit)
    ours.find_hit_asking(block_hashes, first_wanted, max_hit, _oracle(first_wanted, present, []))
    assert len(ours._first_by_shape) == 1

    other_hashes = [os.urandom(32) for _ in block_hashes]
    coordinator = make_coordinator(groups)
    fresh = HybridHitCoordinator.from_vllm_coordinator(coordinator)
    wanted = ours.lookup_blocks(other_hashes, max_hit)
    fresh_wanted = fresh.lookup_blocks(other_hashes, max_hit)
    assert _first_round(ours, other_hashes, wanted, max_hit) == _first_round(
        fresh, other_hashes, fresh_wanted, max_hit
    )
    assert len(ours._first_by_shape) == 1  # the shape's first questions were taken, not computed

    other_present = _presence(data.draw, coordinator, fresh, other_hashes)
    fill_block_pool(coordinator, other_present)
    _, real_hit, _ = coordinator.find_longest_cache_hit(other_hashes, max_hit)
    hit, _ = ours.find_hit_asking(other_hashes, wanted, max_hit, _oracle(wanted, other_present, []))
    assert hit.hit_tokens == real_hit


def _first_round(
    coord: HybridHitCoordinator, block_hashes: list, wanted: dict[int, list[bytes]], max_hit: int
) -> dict[int, list[int]] | None:
    """What a lookup asks first (None: nothing, it is done at once)."""
    try:
        return next(coord.hit_rounds(block_hashes, wanted, max_hit))
    except StopIteration:
        return None


def test_asking_skips_blocks_the_hit_cannot_use() -> None:
    groups = [GroupDesc("full", 32), GroupDesc("sliding_window", 32, window=64), GroupDesc("mamba", 32)]
    ours = HybridHitCoordinator.from_vllm_coordinator(make_coordinator(groups))
    block_hashes = [os.urandom(32) for _ in range(64)]
    wanted = ours.lookup_blocks(block_hashes, 64 * 32 - 1)
    everything = {g: set(hashes) for g, hashes in wanted.items()}
    for present, rounds, hit_blocks in (
        (everything, 1, 63),
        ({g: set() for g in wanted}, 1, 0),
        ({g: set(hashes[:32]) for g, hashes in wanted.items()}, 2, 32),
    ):
        asked: list[int] = []
        hit, known = ours.find_hit_asking(block_hashes, wanted, 64 * 32 - 1, _oracle(wanted, present, asked))
        assert hit.hit_tokens == hit_blocks * 32
        assert len(asked) == rounds
        # Full attention needs its whole prefix; the window and the state only their ends.
        assert len(known[0]) == 63 and len(known[1]) < 8 and len(known[2]) <= 2


def test_asking_without_an_answer_is_a_miss() -> None:
    groups = [GroupDesc("full", 32), GroupDesc("sliding_window", 32, window=64)]
    ours = HybridHitCoordinator.from_vllm_coordinator(make_coordinator(groups))
    block_hashes = [os.urandom(32) for _ in range(8)]
    wanted = ours.lookup_blocks(block_hashes, 8 * 32 - 1)
    hit, _ = ours.find_hit_asking(block_hashes, wanted, 8 * 32 - 1, lambda questions: None)
    assert hit.hit_tokens == 0 and hit.needed_blocks == ((), ()) and hit.group_hit_tokens == (0, 0)


def test_one_eagle_group_drops_its_last_block_like_vllms_unitary_coordinator() -> None:
    # vLLM's one-group coordinator does not look a block past the candidate first.
    coordinator = make_coordinator([GroupDesc("full", 32, eagle=True)])
    ours = HybridHitCoordinator.from_vllm_coordinator(coordinator)
    block_hashes = [os.urandom(32) for _ in range(5)]
    present = {0: {bytes(h) for h in block_hashes}}
    fill_block_pool(coordinator, present)
    _, real_hit, _ = coordinator.find_longest_cache_hit(block_hashes, 5 * 32 - 1)
    assert real_hit == 3 * 32
    assert find_hit(ours, block_hashes, present, 5 * 32 - 1).hit_tokens == real_hit
