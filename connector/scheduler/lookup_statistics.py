"""Per-group lookup statistics over the whole looked-up prefix, off the lookup's path.

A lookup asks the master only about the blocks its fixed point reads. Its
statistics (blocks present per group, each group's own hit: both past vLLM's own
prefix hit, what the pool could add) read every block a hit could have used, so
:func:`lookup_statistics` asks the presence service about the rest (after the
lookups waiting there) and computes the statistics on its thread once answered,
off the scheduler thread that exports them. Read earlier, a record's statistics
wait for that answer, never past its deadline: then they count what the lookup
itself asked about.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.connector.scheduler.lookups import Lookup
    from kvpool.connector.scheduler.presence import Question

#: Per group, past vLLM's own hit: blocks present, and the group's own hit in tokens.
Statistics = tuple[tuple[int, ...], tuple[int, ...]]


def lookup_statistics(
    lookup: Lookup,
    known: dict[int, dict[int, bool]],
    ask: Callable[[Callable[[], list[str]]], Question] | None,
    ranks: Callable[[int], int],
) -> Statistics | Callable[[], Statistics]:
    """``lookup``'s statistics over every looked-up block, given what it ``known`` (per group,
    block index -> held).

    ``ask`` (the presence service's; None after a failed lookup: nothing more is asked)
    asks about the blocks the lookup did not (nothing, when it asked about them all); the
    statistics are computed on the thread that has that answer, or at once without a
    question. Without a question, the statistics themselves; else a function that reads
    them (computing them first if nobody has, never waiting past the question's deadline).
    """
    coord, wanted = lookup.coord, lookup.wanted
    rest: dict[int, list[int]] = {}  # the blocks not asked about: found on the service's thread

    def rest_keys() -> list[str]:
        for g, hashes in wanted.items():
            asked = known[g]
            if indices := [i for i in range(len(hashes)) if i not in asked]:
                rest[g] = indices
        return lookup.keys_of(rest)

    asked_all = all(len(known.get(g, ())) >= len(hashes) for g, hashes in wanted.items())
    question = None if ask is None or asked_all else ask(rest_keys)
    memo: list[Statistics] = []

    def compute() -> Statistics:
        if not memo:
            held = {g: dict(k) for g, k in known.items()}
            flags = None if question is None else question.result()
            if flags is not None:
                for g, answers in read_by_position(rest, flags, ranks).items():
                    held[g].update(zip(rest[g], answers))
            # Past vLLM's own hit: the record's final numbers, so reading them costs nothing.
            local = lookup.query.num_computed_tokens
            present = tuple(
                sum(found for i, found in held.get(g.group_id, {}).items() if i >= local // g.block_size)
                for g in coord.groups
            )
            hits = coord.group_hits(lookup.query.block_hashes, wanted, held, lookup.max_hit, lookup.index_of)
            memo.append((present, tuple(max(0, t - local) for t in hits)))
        return memo[0]

    if question is None:  # nothing to wait for: the numbers themselves
        return compute()
    # Computed ahead, where the answer is (vLLM exports them at its next step anyway).
    question.then(compute)
    return compute


def read_by_position(
    questions: Mapping[int, Sequence[int]], flags: list[bool], ranks: Callable[[int], int]
) -> dict[int, list[bool]]:
    """Per group, whether every rank holds each block, from flags in key order (per group,
    per rank, per block)."""
    answers: dict[int, list[bool]] = {}
    at = 0
    for group_id, indices in questions.items():
        count = len(indices)
        held = flags[at : at + count]
        for _ in range(1, ranks(group_id)):
            at += count
            held = [a and b for a, b in zip(held, flags[at : at + count])]
        at += count
        answers[group_id] = held
    return answers
