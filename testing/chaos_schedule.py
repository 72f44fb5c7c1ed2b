"""The chaos run's fault schedule: which fault, when, for how long, on what; a pure function of a seed.

Each kind is planned ``per_kind`` times. The run's fault window is cut into ``per_kind``
rounds, each holding every kind once in a seeded order, each fault at a seeded time inside
its own slot of the round; with probability ``overlap_chance`` a fault instead starts while
the one before it still holds, so faults of different kinds sometimes overlap. Two faults
of one kind never overlap (two etcd members down would lose etcd's quorum, two stores down
the whole pool, two restarting servers the whole fleet): a fault that would start while
another of its kind holds is moved to just after it. A hold is how long the fault lasts:

* ``store_frozen``: a store process stopped (SIGSTOP) for 1-20 s, then continued;
* ``store_restarted``: a store killed (its objects lost), started again after the hold;
* ``leader_killed``: the leading master killed (a standby takes over), started again as a
  standby after the hold;
* ``etcd_member_restarted``: one etcd member killed, started again after the hold;
* ``server_restarted``: one vLLM server killed with its transfers in flight, started again
  at once (the hold is nought; its start-up is its outage);
* ``server_frozen``: one vLLM server's processes stopped (SIGSTOP) for 1-20 s, then continued:
  where servers hold the pool's memory (co-located), its peers' reads and writes of that
  memory stall;
* ``pool_full``: filler objects put until the pool evicts, kept for the hold;
* ``objects_corrupted``: stored objects of a finished answer overwritten (``upsert``) with
  payloads not their own, so the next turn that loads them meets them;
* ``slow_link``: a delayed, lossy link (``tc netem``) for the hold, where the platform has one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class FaultKind(StrEnum):
    STORE_FROZEN = "store_frozen"
    STORE_RESTARTED = "store_restarted"
    LEADER_KILLED = "leader_killed"
    ETCD_MEMBER_RESTARTED = "etcd_member_restarted"
    SERVER_RESTARTED = "server_restarted"
    SERVER_FROZEN = "server_frozen"
    POOL_FULL = "pool_full"
    OBJECTS_CORRUPTED = "objects_corrupted"
    SLOW_LINK = "slow_link"


#: Seconds each kind holds: (shortest, longest), drawn uniformly.
HOLDS: dict[FaultKind, tuple[float, float]] = {
    FaultKind.STORE_FROZEN: (1.0, 20.0),
    FaultKind.STORE_RESTARTED: (1.0, 8.0),
    FaultKind.LEADER_KILLED: (5.0, 15.0),
    FaultKind.ETCD_MEMBER_RESTARTED: (2.0, 10.0),
    FaultKind.SERVER_RESTARTED: (0.0, 0.0),
    FaultKind.SERVER_FROZEN: (1.0, 20.0),
    FaultKind.POOL_FULL: (5.0, 15.0),
    FaultKind.OBJECTS_CORRUPTED: (0.0, 0.0),
    FaultKind.SLOW_LINK: (5.0, 20.0),
}


@dataclass(frozen=True)
class PlannedFault:
    """One fault of the schedule; times in seconds from the start of the traffic."""

    kind: FaultKind
    at: float
    hold: float
    target: int  # which store, server or etcd member (an index the run maps); 0 where moot

    @property
    def until(self) -> float:
        return self.at + self.hold


def plan(
    seed: int,
    *,
    start: float,
    end: float,
    kinds: Sequence[FaultKind],
    per_kind: int,
    targets: dict[FaultKind, int] | None = None,
    overlap_chance: float = 0.25,
    max_hold: float | None = None,
) -> list[PlannedFault]:
    """Every fault of a run, sorted by start: ``per_kind`` of each of ``kinds`` in ``[start, end)``.

    ``targets`` gives how many things a kind may hit (stores, servers, etcd members; 1 when
    absent); ``max_hold`` caps every hold (a short run's faults end sooner). A fault moved
    past another of its kind may start after ``end``, by at most that one's hold.
    """
    if end <= start or per_kind < 1 or not kinds:
        raise ValueError("an empty fault window")
    rng = random.Random(seed)
    counts = targets or {}
    slots = len(kinds) * per_kind
    width = (end - start) / slots
    faults: list[PlannedFault] = []
    for round_index in range(per_kind):
        order = list(kinds)
        rng.shuffle(order)
        for position, kind in enumerate(order):
            slot_start = start + (round_index * len(kinds) + position) * width
            low, high = HOLDS[kind]
            hold = round(rng.uniform(low, high), 3)
            if max_hold is not None:
                hold = min(hold, max_hold)
            at = slot_start + rng.uniform(0.0, 0.5) * width
            if faults and rng.random() < overlap_chance and faults[-1].hold > 0:
                before = faults[-1]
                at = before.at + rng.uniform(0.1, 0.9) * before.hold
            at = _after_same_kind(faults, kind, at)
            target = rng.randrange(counts.get(kind, 1))
            faults.append(PlannedFault(kind, math.ceil(at * 1000) / 1000, hold, target))
    return sorted(faults, key=lambda f: f.at)


def _after_same_kind(faults: Sequence[PlannedFault], kind: FaultKind, at: float) -> float:
    """``at``, or a second after every fault of ``kind`` that would still hold then."""
    moved = True
    while moved:
        moved = False
        for fault in faults:
            if fault.kind == kind and fault.at - 1.0 < at < fault.until + 1.0:
                at, moved = fault.until + 1.0, True
    return at


def overlapping(faults: Sequence[PlannedFault]) -> list[tuple[PlannedFault, PlannedFault]]:
    """Pairs of faults of which the later starts while the earlier holds."""
    ordered = sorted(faults, key=lambda f: f.at)
    return [(a, b) for i, a in enumerate(ordered) for b in ordered[i + 1 :] if a.at <= b.at < a.until]
