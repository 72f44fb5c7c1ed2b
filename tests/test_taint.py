"""The worker's taint bookkeeping: which saves were computed from blocks a failed load left wrong.

Block ids and steps only (no engine): each case is a step sequence vLLM produces after a
failed synchronous load (see ``connector/taint.py``).
"""

from __future__ import annotations

from kvpool.connector.metadata import GroupTransfer, RequestSave, SaveLineage
from kvpool.connector.taint import BlockTaint

# R1's blocks: 0..8 loaded from the pool, 9 and on computed.
R1_BLOCKS = list(range(12))


def save(req: str, prefix: list[int], computed_from: int, unsaved_from: int, since: int) -> RequestSave:
    lineage = SaveLineage(prefix=prefix, computed_from=computed_from, unsaved_from=unsaved_from)
    return RequestSave(req, [GroupTransfer(0, lineage=lineage)], since_step=since)


def blocks(*ids: int) -> list[tuple[int, int]]:
    return [(0, b) for b in ids]


def test_nothing_is_dropped_without_taint() -> None:
    taint = BlockTaint()
    assert taint.screen([save("r", R1_BLOCKS, 9, 9, since=0)], step=0) == []
    assert not taint


def test_a_save_of_the_failed_step_is_dropped_and_taints_what_it_wrote() -> None:
    taint = BlockTaint()
    taint.taint(blocks(4, 5, 6, 7, 8), step=3)  # the step's load of blocks 4..8 failed
    r1 = save("r1", R1_BLOCKS[:11], computed_from=9, unsaved_from=9, since=3)
    clean = save("other", [50, 51, 52], computed_from=2, unsaved_from=2, since=1)
    assert taint.screen([r1, clean], step=3) == [r1]
    assert (0, 9) in taint and (0, 10) in taint
    assert (0, 52) not in taint


def test_a_same_step_sharer_is_dropped() -> None:
    """Another request of the step reused the failed blocks through the local prefix cache."""
    taint = BlockTaint()
    taint.taint(blocks(4, 5, 6, 7, 8), step=3)
    sharer = save("r2", [*R1_BLOCKS[:10], 20, 21], computed_from=10, unsaved_from=10, since=3)
    assert taint.screen([sharer], step=3) == [sharer]
    assert (0, 20) in taint and (0, 21) in taint


def test_the_recompute_is_saved_and_cleans_what_it_rewrote() -> None:
    taint = BlockTaint()
    taint.taint(blocks(4, 5, 6, 7, 8), step=3)
    taint.screen([save("r1", R1_BLOCKS[:11], 9, 9, since=3)], step=3)
    # vLLM moved R1 back to block 4: step 4 recomputes blocks 4..10 from their first token.
    recompute = save("r1", R1_BLOCKS[:11], computed_from=4, unsaved_from=4, since=3)
    assert taint.screen([recompute], step=4) == []
    assert not any(b in taint for b in blocks(4, 5, 6, 7, 8, 9, 10))


def test_a_reader_of_blocks_rewritten_in_its_step_passes_only_if_it_read_nothing_earlier() -> None:
    taint = BlockTaint()
    taint.taint(blocks(4, 5, 6, 7, 8), step=3)
    recompute = save("r1", R1_BLOCKS[:11], computed_from=4, unsaved_from=4, since=3)
    # Admitted in step 4 with a local hit on blocks 0..9: it read them in step 4 only.
    newcomer = save("r3", [*R1_BLOCKS[:10], 30], computed_from=10, unsaved_from=10, since=4)
    # Computing since step 3: it read blocks 4..8 while they were wrong.
    old_reader = save("r4", [*R1_BLOCKS[:10], 40], computed_from=10, unsaved_from=10, since=3)
    # Listed first: decided once the recompute passes, whatever the order.
    assert taint.screen([newcomer, old_reader, recompute], step=4) == [old_reader]


def test_reading_what_a_dropped_save_wrote_in_the_same_step_drops_the_reader() -> None:
    taint = BlockTaint()
    taint.taint(blocks(4), step=3)
    writer = save("w", [1, 2, 3, 4, 60], computed_from=4, unsaved_from=4, since=3)  # reads 4
    reader = save("r", [1, 2, 3, 4, 60, 61], computed_from=5, unsaved_from=5, since=3)  # reads 60
    assert taint.screen([reader, writer], step=3) == [reader, writer]


def test_a_request_that_read_wrong_blocks_between_its_saves_is_dropped_later() -> None:
    """A step scheduled before the failure was known reads the wrong blocks without saving;
    its next save comes after the blocks were rewritten, and is dropped all the same."""
    taint = BlockTaint()
    taint.taint(blocks(4, 5, 6, 7, 8), step=3)
    taint.screen([save("r1", R1_BLOCKS[:11], 4, 4, since=3)], step=5)  # rewritten at step 5
    late = save("r5", [*R1_BLOCKS[:10], 70, 71], computed_from=11, unsaved_from=10, since=4)
    assert taint.screen([late], step=7) == [late]


def test_new_blocks_hold_nothing_wrong() -> None:
    taint = BlockTaint()
    taint.taint(blocks(4, 5), step=3)
    taint.forget(blocks(4, 5))
    assert not taint
    assert taint.screen([save("r", [4, 5, 6], 2, 2, since=9)], step=9) == []
