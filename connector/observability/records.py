"""What the connector observed: lookups on the scheduler, transfers on workers.

Records are plain data without prompt text or token ids. The metrics and
tracing layers consume them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, overload

from kvpool.connector.pool_client import Outcome

TRACE_HEADERS = ("traceparent", "tracestate")


@dataclass(slots=True)
class LookupRecord:
    """One scheduler lookup: what the pool held and what the hybrid hit kept (made on the
    presence service's thread; the scheduler thread sets ``deferred_steps`` once it takes the
    answer, before recording it, and nothing changes it after)."""

    query_tokens: int
    hit_tokens: int
    group_kinds: tuple[str, ...]
    looked_up_blocks: tuple[int, ...]  # every block the lookup may ask about, from block 0
    # Per group, past vLLM's own prefix hit (what the pool could add, as query_tokens):
    present_blocks: Sequence[int]  # a statistic: may be a Deferred, computed when read
    needed_blocks: tuple[int, ...]  # blocks the reconciled hit loads
    group_hit_tokens: Sequence[int]  # a statistic: may be a Deferred, computed when read
    seconds: float
    keys: int
    failures: Mapping[str, int] = field(default_factory=dict)  # by reason (e.g. timeout: a miss)
    deferred_steps: int = 0  # scheduler steps the request skipped waiting for this answer
    timed: bool = True  # False: it raised before it was timed (``seconds`` means nothing)


def failed_lookup(group_kinds: tuple[str, ...], request: Any, num_computed_tokens: int) -> LookupRecord:
    """A lookup that raised: a miss of the request's tokens past its local hit, counted failed
    (``Outcome.OTHER``) so the lookup failure metrics and alert see it; not timed."""
    zeros = tuple(0 for _ in group_kinds)
    return LookupRecord(
        query_tokens=max(0, int(getattr(request, "num_tokens", 0)) - num_computed_tokens),
        hit_tokens=0,
        group_kinds=group_kinds,
        looked_up_blocks=zeros,
        present_blocks=zeros,
        needed_blocks=zeros,
        group_hit_tokens=zeros,
        seconds=0.0,
        keys=0,
        failures={Outcome.OTHER.value: 1},
        timed=False,
    )


class Deferred(Sequence[int]):
    """Per-group counts computed on their first read, so only exported statistics cost time."""

    __slots__ = ("_compute", "_values")

    def __init__(self, compute: Callable[[], Sequence[int]]):
        self._compute: Callable[[], Sequence[int]] | None = compute
        self._values: tuple[int, ...] | None = None

    def _get(self) -> tuple[int, ...]:
        if self._values is None:
            assert self._compute is not None
            self._values, self._compute = tuple(self._compute()), None
        return self._values

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...
    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        return self._get()[index]

    def __len__(self) -> int:
        return len(self._get())

    def __iter__(self) -> Iterator[int]:
        return iter(self._get())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return self._get() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._get())

    def __repr__(self) -> str:
        return repr(self._get())

    def __reduce__(self) -> tuple[Any, ...]:
        # Copied or pickled, it is the plain counts.
        return tuple, (self._get(),)


@dataclass(frozen=True)
class TransferRecord:
    """One request's load or save on one worker, per group."""

    operation: str  # "load" or "save"
    group_kinds: tuple[str, ...]
    blocks: tuple[int, ...]
    masked: tuple[int, ...]
    bytes: tuple[int, ...]
    failures: Mapping[str, int]  # all groups together, by reason
    seconds: float  # the whole request
    group_failures: tuple[Mapping[str, int], ...] = ()
    group_seconds: tuple[float, ...] = ()
    group_attempted: tuple[bool, ...] = ()  # whether the group had blocks to move
    direct_blocks: int = 0  # a load's blocks copied straight from this process's own segment
    # Per group: the bytes of a save's blocks the pool already held (in ``blocks``, not in
    # ``bytes``: none of them moved).
    held_bytes: tuple[int, ...] = ()
    load_error_blocks: int = 0  # blocks handed back to vLLM to recompute
    recomputed: bool = False  # the whole request was sent back to recompute
    reason: str = ""  # operation "remove": why the objects (``blocks`` per group) were removed
    # The worker's rank in its engine (tensor and pipeline); None: not one rank's view. Every
    # rank moves the same blocks of a request, each its own keys: only rank 0 counts the blocks
    # (and their masks, latencies), every rank its bytes, keys moved and keys failed; the
    # scheduler counts what vLLM recomputes, and each transfer's bytes over every rank (the
    # request's bytes, ``vllm:kvpool_transfer_size_bytes``) once every rank reported it.
    rank: int | None = None
    # vLLM's request id: how the scheduler joins the ranks' records of one transfer (never
    # exported; records without one join in the order they arrive).
    req_id: str = ""


@dataclass
class StatsCollector:
    """Thread-safe buffer of records, drained by the metrics layer."""

    group_kinds: tuple[str, ...] = ()
    rank: int | None = None  # a worker's rank in its engine: stamped on its transfer records
    lookups: list[LookupRecord] = field(default_factory=list)
    transfers: list[TransferRecord] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_lookup(self, record: LookupRecord, request: Any = None) -> None:
        with self._lock:
            self.lookups.append(record)

    def record_transfer(self, record: TransferRecord) -> None:
        if self.rank is not None and record.rank is None:
            record = replace(record, rank=self.rank)
        with self._lock:
            self.transfers.append(record)

    def drain(self) -> tuple[list[LookupRecord], list[TransferRecord]]:
        with self._lock:
            lookups, transfers = self.lookups, self.transfers
            self.lookups, self.transfers = [], []
        return lookups, transfers

    @staticmethod
    def trace_context(request: Any) -> dict[str, str]:
        """The W3C trace headers vLLM's request carries, if any."""
        headers = getattr(request, "trace_headers", None) or {}
        return {k: v for k, v in headers.items() if k.lower() in TRACE_HEADERS}
