"""What the scheduler side keeps about one request, from its first lookup until it finishes.

One :class:`RequestState` per request, in one dict of ``SchedulerSide`` (forgotten in
one place, ``request_finished``): its lookup (queued, then answered, kept until vLLM
allocates its blocks), the load planned from it, and the progress of its saves.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.connector.scheduler.hybrid_hit import HybridHit
from kvpool.connector.scheduler.load_decision import Verdict
from kvpool.connector.scheduler.presence import PendingLookup


@dataclass
class LookedUp:
    """A request's answered lookup, kept until vLLM allocates its blocks (or it grows stale)."""

    hit: HybridHit
    digests: dict[int, dict[int, str]]  # group -> block index -> digest (of the blocks asked)
    num_tokens: int  # the request's length when it was looked up
    answered_at: float = field(default_factory=time.perf_counter)
    verdict: Verdict | None = None  # load or recompute its hit: decided once per answer
    # The pool answered every question of the lookup (no failure, no deadline missed): its
    # hit is what the pool holds of the prompt, not a miss for want of an answer.
    complete: bool = True


@dataclass
class LoadPlan:
    """The pool's part of a request's hit, to load once vLLM allocates its blocks."""

    hit: HybridHit
    local_tokens: int  # vLLM's own prefix hit, below which nothing is loaded
    digests: dict[int, dict[int, str]]  # group -> block index -> digest (of the blocks asked)


@dataclass
class SaveProgress:
    """How far the blocks of a request the connector saves are planned."""

    request: Any
    saved_upto: list[int]  # per group: block index below which nothing is left to save
    trace_context: dict[str, str] = field(default_factory=dict)
    # Per group: blocks below this index that are saved again after a failed load
    # replace whatever the pool holds under their keys.
    replace_upto: list[int] = field(default_factory=list)
    # Tokens computed from which some group completes a block it has not saved
    # (0: not known). Below it a step plans nothing: most decode steps.
    next_save_at: int = 0

    def note_saved(self, block_sizes: Sequence[int]) -> None:
        """Recompute :attr:`next_save_at` after ``saved_upto`` moved."""
        self.next_save_at = min((done + 1) * size for done, size in zip(self.saved_upto, block_sizes))

    def rewind(self, upto: Sequence[int]) -> None:
        """Save again from block ``upto[g]`` of each group; the blocks re-saved below the old
        mark replace whatever the pool holds under their keys."""
        if not self.replace_upto:
            self.replace_upto = [0] * len(self.saved_upto)
        for gid, mark in enumerate(upto):
            if mark < self.saved_upto[gid]:
                self.replace_upto[gid] = max(self.replace_upto[gid], self.saved_upto[gid])
                self.saved_upto[gid] = mark
        self.next_save_at = 0


@dataclass
class RequestState:
    """One request's lookup, load and saves on the scheduler side."""

    # Its lookup: queued or in flight, then answered.
    pending: PendingLookup | None = None
    # Its answer went stale before vLLM reached it, and it was asked again: the next answer
    # is taken however old (a request reached less often than the deadline is not deferred
    # forever; an old answer costs at most a failed load).
    asked_again: bool = False
    looked_up: LookedUp | None = None
    local_tokens: int | None = None  # vLLM's own prefix hit when it was last asked
    plan: LoadPlan | None = None  # set while the hit reaches past the local one
    # Its load, once allocated.
    loading: bool = False  # an asynchronous load may still write its blocks
    loaded_blocks: set[int] | None = None  # the block ids it writes, until reported finished
    # Of those, the ones some rank reported failed (another rank may report them in a later step).
    failed_blocks: set[int] = field(default_factory=set)
    load_failed: bool = False  # it recomputes, and never takes the pool's word again
    # Its saves, once allocated (a connector that saves).
    saves: SaveProgress | None = None

    def cancel_lookup(self) -> None:
        """Drop the lookup queued or in flight, if any: nobody takes its answer."""
        if self.pending is not None:
            self.pending.cancel()
            self.pending = None
