"""Scheduler lookups asked together: many requests' fixed points, one existence check per round.

A :class:`Lookup` is one request's hybrid fixed point (``hit_rounds``) over
what the master holds, built from a copy of what it needs of vLLM's request
(block hashes, length), so it can run off the scheduler thread while vLLM
mutates the request. :func:`answer_together` answers many: each round resumes
every unfinished fixed point with its answers, gathers the blocks each one
reads next, and asks the master about all of them in one call; a fixed point's
result depends only on what it read, so each hit is exactly the one it finds
answered alone (usually two rounds at most: the first questions, and a
few keys for a shorter candidate; one when every block the lookup could read is
at most :data:`ASK_AHEAD_KEYS` more keys than its first questions: then it asks
about them all at once).

The presence service (:mod:`kvpool.connector.scheduler.presence`) holds the
lookups vLLM asked for during a ``schedule()`` and hands them to its thread when
the step's scheduling ends (from ``build_connector_meta``), so every request
that waited in one step is answered by one batched call while the model runs,
instead of one call per request inside the scheduler loop. Flushing per step
rather than per request keeps each step to one call (the first request of a
step would otherwise go alone) and leaves the scheduler loop free of the
thread's work while it runs. A round's keys go in one call (benchmarks/README.md,
finding 3).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from kvpool.connector.contract.keys import hash_digests
from kvpool.connector.scheduler.hybrid_hit import Found, HybridHitCoordinator, Rounds, block_indices
from kvpool.connector.scheduler.lookup_statistics import read_by_position

#: ``exists(keys, deadline)`` -> (presence of each key, failure reason or None); the deadline is
#: on the clock of the lookups' queries.
Exists = Callable[[list[str], float], tuple[list[bool], str | None]]
Questions = Mapping[int, Sequence[int]]

#: Keys a lookup's first existence check may carry beyond its first round's, to ask about
#: every block it could read in one round trip instead of two on a partial hit. A second
#: round trip cost ~0.27 ms and a key ~0.6 µs in one call (benchmarks/README.md, finding 2);
#: the per-group statistics ask about those keys anyway, on a check of their own.
ASK_AHEAD_KEYS = 256


@dataclass(slots=True)
class LookupQuery:
    """What a lookup needs of vLLM's request, copied on the scheduler thread; never changed
    after (not frozen only because a frozen dataclass costs ~0.75 µs more to make, per lookup)."""

    req_id: str
    block_hashes: list[Any]
    num_tokens: int
    num_computed_tokens: int
    trace_context: dict[str, str]
    started: float  # perf_counter when asked for
    started_ns: int  # the same instant, in epoch nanoseconds (spans)
    deadline: float  # perf_counter past which it is a miss


class Lookup:
    """One request's fixed point over the master's presence answers.

    Built on the scheduler thread from its query alone; what costs time (the blocks
    it may use, :attr:`wanted`) is computed on first use, on the thread answering it.
    """

    def __init__(
        self,
        coord: HybridHitCoordinator,
        query: LookupQuery,
        rank_prefixes: Callable[[int], tuple[str, ...]],
        ranks: Callable[[int], int],
    ):
        self.coord = coord
        self.query = query
        self.max_hit = query.num_tokens - 1
        self.digests: dict[int, dict[int, str]] = defaultdict(dict)  # group -> index -> digest
        self.asked_keys = 0
        self.failures: dict[str, int] = {}
        self.result: Found | None = None
        self._rank_prefixes = rank_prefixes
        self._ranks = ranks
        self._rounds: Rounds | None = None
        self._reply: Mapping[int, Sequence[bool]] | None = None  # the answer to the last round
        self._digests_of: dict[int, dict[int, str]] = {}  # id of a wanted list -> index -> digest

    @cached_property
    def wanted(self) -> dict[int, list[bytes]]:
        """Per group, the hashes of the blocks a hit may use (``lookup_blocks``)."""
        return self.coord.lookup_blocks(self.query.block_hashes, self.max_hit)

    @cached_property
    def index_of(self) -> dict[int, dict[bytes, int]]:
        """Per group, each of :attr:`wanted`'s hashes -> its index."""
        return block_indices(self.wanted)

    def keys_of(self, questions: Questions) -> list[str]:
        """The keys of ``questions``: per group, per rank, per block (read back by position)."""
        keys: list[str] = []
        for group_id, indices in questions.items():
            hashes = self.wanted[group_id]
            # Groups of one block size share their hashes: each block's digest is made once.
            shared = self._digests_of.setdefault(id(hashes), {})
            if all(i in shared for i in indices):
                ordered = [shared[i] for i in indices]
            else:
                ordered = hash_digests(hashes, indices)
                shared.update(zip(indices, ordered))
            self.digests[group_id].update(zip(indices, ordered))
            for prefix in self._rank_prefixes(group_id):
                keys += [prefix + digest for digest in ordered]
        return keys

    # --- rounds answered from outside ---------------------------------------------------
    def attempt(self) -> Questions | None:
        """Resume the fixed point with the last round's answer: the questions it needs
        answered next, or None when it is done (:attr:`result`)."""
        if self.result is not None:
            return None  # done: asked again, it neither starts over nor asks anything
        try:
            if self._rounds is None:
                self._rounds = self.coord.hit_rounds(
                    self.query.block_hashes,
                    self.wanted,
                    self.max_hit,
                    ask_ahead_blocks=ASK_AHEAD_KEYS // max((self._ranks(g) for g in self.wanted), default=1),
                    index_of=self.index_of,
                )
                return next(self._rounds)
            reply, self._reply = self._reply, None
            return self._rounds.send(reply)
        except StopIteration as done:
            self.result = done.value
            self._rounds = None
            return None

    def answer(self, questions: Questions, flags: list[bool] | None, failure: str | None) -> None:
        """The master's answer to ``questions`` (None, with ``failure``: it could not tell)."""
        if flags is None:
            self.failures[failure or "error"] = 1
            self._reply = None
            return
        self._reply = read_by_position(dict(questions), flags, self._ranks)


def answer_together(lookups: Sequence[Lookup], exists: Exists) -> int:
    """Answer ``lookups`` with one existence check per round; the number of checks made.

    A check's deadline is the earliest of its lookups'; past it, or when the master
    cannot tell, every lookup in that round is a miss.
    """
    calls = 0
    waiting = list(lookups)
    while waiting:
        asking: list[tuple[Lookup, Questions, int]] = []
        keys: list[str] = []
        for lookup in waiting:
            questions = lookup.attempt()
            if questions is None:
                continue
            lookup_keys = lookup.keys_of(questions)
            lookup.asked_keys += len(lookup_keys)
            keys += lookup_keys
            asking.append((lookup, questions, len(lookup_keys)))
        if not asking:
            break
        deadline = min(lookup.query.deadline for lookup, _, _ in asking)
        flags, failure = exists(keys, deadline)
        calls += 1
        at = 0
        for lookup, questions, count in asking:
            lookup.answer(questions, None if failure else flags[at : at + count], failure)
            at += count
        waiting = [lookup for lookup, _, _ in asking]
    return calls
