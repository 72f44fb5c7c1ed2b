"""The chaos run's history: every request, every fault and every sample, as JSON lines.

Times are seconds since the traffic started. One line per record, ``{"type": ..., ...}``;
:func:`write` and :func:`read` are each other's inverse, so a history can be judged again
(or by hand) after the run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: How a request ended, as the client saw it.
COMPLETED = "completed"  # every token streamed
DISCONNECTED = "disconnected"  # the client hung up on purpose (its plan)
REFUSED = "refused"  # an HTTP error with a message, or the connection refused
FAILED = "failed"  # the stream broke, or ended short of its tokens
TIMED_OUT = "timed_out"  # the client's own timeout ended it

#: Where a client planned to hang up.
BEFORE_FIRST_TOKEN = "before_first_token"
MID_DECODE = "mid_decode"


def prompt_key(prompt: list[int]) -> str:
    """A short name of a prompt's token ids (references are kept by it)."""
    return hashlib.sha256(json.dumps(prompt).encode()).hexdigest()[:24]


@dataclass
class RequestRecord:
    """One streaming completion as the client saw it."""

    id: int
    server: int
    user: int
    turn: int
    prompt: list[int]
    max_tokens: int
    sent: float
    first: float | None = None
    ended: float | None = None
    tokens: list[int] = field(default_factory=list)
    outcome: str = FAILED
    error: str | None = None
    disconnect: str | None = None
    phase: str = "chaos"  # "chaos", or "control" (the negative control's traffic)


@dataclass
class FaultRecord:
    """One fault as injected: planned time, when it began and when it stopped holding."""

    kind: str
    target: int
    planned_at: float
    started: float
    ended: float | None = None  # None: never ended (the run stopped first)
    detail: str = ""
    error: str | None = None  # the injection itself failed
    phase: str = "chaos"


@dataclass
class ProcSample:
    """``/proc`` of one server's processes (the API server, its engine core and worker), summed."""

    t: float
    server: int
    generation: int  # how many times that server was restarted before
    rss_bytes: int
    threads: int
    fds: int


@dataclass
class MetricsSample:
    """Counters of one server's ``/metrics`` at ``t`` (cumulative within a generation)."""

    t: float
    server: int
    generation: int
    series: dict[str, float]


Record = RequestRecord | FaultRecord | ProcSample | MetricsSample
_TYPES: dict[str, type[Any]] = {
    "request": RequestRecord,
    "fault": FaultRecord,
    "proc": ProcSample,
    "metrics": MetricsSample,
}
_NAMES = {cls: name for name, cls in _TYPES.items()}


@dataclass
class History:
    """A run's records, by type."""

    requests: list[RequestRecord] = field(default_factory=list)
    faults: list[FaultRecord] = field(default_factory=list)
    procs: list[ProcSample] = field(default_factory=list)
    metrics: list[MetricsSample] = field(default_factory=list)

    def add(self, record: Record) -> None:
        {
            RequestRecord: self.requests,
            FaultRecord: self.faults,
            ProcSample: self.procs,
            MetricsSample: self.metrics,
        }[type(record)].append(record)  # type: ignore[attr-defined]

    def records(self) -> list[Record]:
        return [*self.faults, *self.requests, *self.procs, *self.metrics]

    def phase(self, name: str) -> History:
        """The requests and faults of one phase (samples are shared)."""
        return History(
            [r for r in self.requests if r.phase == name],
            [f for f in self.faults if f.phase == name],
            self.procs,
            self.metrics,
        )


def line(record: Record) -> str:
    return json.dumps({"type": _NAMES[type(record)], **asdict(record)}, separators=(",", ":"))


def write(path: Path, records: Iterable[Record]) -> None:
    with path.open("w") as out:
        for record in records:
            out.write(line(record) + "\n")


def read(path: Path) -> History:
    history = History()
    for text in path.read_text().splitlines():
        if text.strip():
            fields = json.loads(text)
            history.add(_TYPES[fields.pop("type")](**fields))
    return history
