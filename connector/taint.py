"""Which KV blocks may hold wrong bytes, and which saves were computed from them.

A block whose load failed holds whatever was there before; vLLM recomputes it, but a
forward that ran in between (the same step, or a step scheduled before the failure
was known) read it, and so did every block that forward wrote. Such blocks must never
reach the pool. :class:`BlockTaint` keeps, per block, the steps during which it may
have been wrong, and screens each step's saves: a save whose request read a block
while it was wrong (or read a block a dropped save of this step wrote) is dropped,
and what its request wrote since its previous save becomes tainted in turn. A block
rewritten from its first token by a save that passes is clean from that step on, and
a newly allocated block is clean (nothing reads what it held before).

Pure bookkeeping on block ids and step numbers: no vLLM, no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.connector.metadata import RequestSave

Block = tuple[int, int]  # (group id, block id)


@dataclass
class _Span:
    """Steps ``[first, until)`` during which a block may have been wrong (``until`` None: still)."""

    first: int
    until: int | None = None

    def overlaps(self, since: int, step: int) -> bool:
        """Whether the block may have been wrong during any step of ``[since, step]``."""
        return self.first <= step and (self.until is None or self.until > since)


class BlockTaint:
    """Blocks that may hold wrong KV, with the steps they may have been wrong in."""

    def __init__(self) -> None:
        self._spans: dict[Block, _Span] = {}

    def __bool__(self) -> bool:
        return bool(self._spans)

    def __contains__(self, block: Block) -> bool:
        span = self._spans.get(block)
        return span is not None and span.until is None

    def taint(self, blocks: Sequence[Block], step: int) -> None:
        """``blocks`` may be wrong from ``step`` on (until rewritten or reallocated)."""
        for block in blocks:
            span = self._spans.get(block)
            if span is None:
                self._spans[block] = _Span(step)
            else:
                span.first = min(span.first, step)
                span.until = None

    def forget(self, blocks: Sequence[Block]) -> None:
        """Newly allocated blocks: no request reads what they held."""
        for block in blocks:
            self._spans.pop(block, None)

    def screen(self, saves: Sequence[RequestSave], step: int) -> list[RequestSave]:
        """The saves of ``step`` computed from possibly wrong blocks; updates the taint.

        Decided together: a block one save reads may be rewritten in this same step by
        another (vLLM writes a step's KV before attention reads it), so a save passes
        once every block it read is clean, and its rewrites clean their blocks for the
        saves that read them. What never passes is dropped.
        """
        if not self._spans:
            return []
        writer: dict[Block, int] = {}
        for index, save in enumerate(saves):
            for block in _written(save):
                writer[block] = index
        passed: set[int] = set()
        undecided = set(range(len(saves)))
        progress = True
        while progress and undecided:
            progress = False
            for index in sorted(undecided):
                verdict = self._read_clean(saves[index], step, writer, passed, undecided)
                if verdict is None:
                    continue
                undecided.discard(index)
                progress = True
                if verdict:
                    passed.add(index)
                    self._rewritten(_written(saves[index]), step)
        dropped = [save for index, save in enumerate(saves) if index not in passed]
        for save in dropped:
            self.taint(_unsaved(save), save.since_step)
        return dropped

    def _read_clean(
        self,
        save: RequestSave,
        step: int,
        writer: dict[Block, int],
        passed: set[int],
        undecided: set[int],
    ) -> bool | None:
        """True if every block ``save`` read was clean, False if one was not, None: not known yet."""
        waiting = False
        for block in _read(save):
            source = writer.get(block)
            if source is not None and source in undecided:
                waiting = True  # rewritten in this step by a save not decided yet
                continue
            if source is not None and source not in passed:
                return False  # rewritten in this step from wrong KV
            span = self._spans.get(block)
            if span is not None and span.overlaps(save.since_step, step):
                return False
        return None if waiting else True

    def _rewritten(self, blocks: list[Block], step: int) -> None:
        for block in blocks:
            span = self._spans.get(block)
            if span is not None and span.until is None:
                span.until = step


def _read(save: RequestSave) -> list[Block]:
    return [(t.group_id, b) for t in save.groups if t.lineage is not None for b in t.lineage.read]


def _written(save: RequestSave) -> list[Block]:
    return [(t.group_id, b) for t in save.groups if t.lineage is not None for b in t.lineage.written]


def _unsaved(save: RequestSave) -> list[Block]:
    return [(t.group_id, b) for t in save.groups if t.lineage is not None for b in t.lineage.unsaved]
