"""The chaos run's judgement: pure functions over its history (:mod:`testing.chaos_history`).

* **Right answers**: a completed request's tokens equal the reference (a server without any
  cache, greedy) for its prompt; a request the client hung up on streamed a prefix of it.
* **Nothing hangs**: every request ended within ``bound_s`` of being sent (completed,
  refused with an error, or hung up on by its client); a request refused or cut off while its
  server restarted is counted as such, not hidden; any other broken stream is a failure.
* **The pool heals**: after each fault ends, the fleet's pool hit rate (hit tokens over
  tokens looked up, from the servers' counters) comes back to ``fraction`` of its level
  before the fault within ``recovery_bound_s``.
* **No leaks**: each server process generation's RSS, threads and file descriptors after
  warm-up stay within a stated growth of their first level.
* **Metrics agree**: each server generation that lived to the end counted as many finished
  requests as the history completed on it (plus at most those its clients hung up on), every
  failure reason is one of the connector's, and a pool outage under traffic shows in
  ``vllm:kvpool_failures_total``.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvpool.connector.pool_client import FAILURE_OUTCOMES, Outcome
from testing.chaos_history import (
    COMPLETED,
    DISCONNECTED,
    FAILED,
    REFUSED,
    TIMED_OUT,
    FaultRecord,
    History,
    MetricsSample,
    ProcSample,
    RequestRecord,
    prompt_key,
)

SERVER_RESTARTED = "server_restarted"
SERVER_FROZEN = "server_frozen"
#: Seconds after a server is ready again (or continued) during which errors still count as its
#: restart's or freeze's (a client connection opened before the kill may report late).
RESTART_SLACK_S = 2.0
#: Metric series names the judgement reads (``MetricsSample.series`` keys).
QUERY_TOKENS = "vllm:kvpool_lookup_query_tokens_total"
HIT_TOKENS = "vllm:kvpool_lookup_hit_tokens_total"
FINISHED_LENGTH = 'vllm:request_success_total{finished_reason="length"}'
FAILURES_PREFIX = "vllm:kvpool_failures_total"
TRANSFER_BLOCKS_PREFIX = "vllm:kvpool_transfer_blocks_total{"
#: The connector's failure outcomes but its catch-all: a reason outside them is unexplained.
KNOWN_FAILURE_REASONS = {o.value for o in FAILURE_OUTCOMES} - {Outcome.OTHER.value}
#: Faults that take pool memory or its master away: under traffic, failures must be counted.
POOL_OUTAGES = {"store_frozen", "store_restarted", "leader_killed"}


# --- answers and hangs -------------------------------------------------------------------------
def wrong_answers(
    requests: Iterable[RequestRecord], references: Mapping[str, list[int]]
) -> list[RequestRecord]:
    """Completed requests whose tokens differ from their prompt's reference, and hung-up ones
    whose streamed tokens are not a prefix of it. A missing reference is wrong (unjudged)."""
    wrong = []
    for request in requests:
        if request.outcome not in (COMPLETED, DISCONNECTED) or (
            request.outcome == DISCONNECTED and not request.tokens
        ):
            continue
        reference = references.get(prompt_key(request.prompt))
        if reference is None or request.tokens != (
            reference if request.outcome == COMPLETED else reference[: len(request.tokens)]
        ):
            wrong.append(request)
    return wrong


def restart_windows(faults: Iterable[FaultRecord], end: float) -> dict[int, list[tuple[float, float]]]:
    """Per server: (killed, ready again + slack) of each of its restarts, and (stopped,
    continued + slack) of each freeze: its HTTP server may reset a connection it held then,
    as it is continued (seen at once, before any engine step)."""
    out: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for fault in faults:
        if fault.kind in (SERVER_RESTARTED, SERVER_FROZEN):
            out[fault.target].append((fault.started, (fault.ended or end) + RESTART_SLACK_S))
    return out


@dataclass
class Fates:
    """How the requests ended."""

    completed: list[RequestRecord] = field(default_factory=list)
    disconnected: list[RequestRecord] = field(default_factory=list)  # by the client's plan
    refused: list[RequestRecord] = field(default_factory=list)  # an error, not during a restart
    refused_in_restart: list[RequestRecord] = field(default_factory=list)  # refused or cut by one
    # (or by a freeze of its server)
    failed: list[RequestRecord] = field(default_factory=list)  # broke without a restart to explain it
    hung: list[RequestRecord] = field(default_factory=list)  # past the bound, or never ended


def fates(requests: Iterable[RequestRecord], faults: Sequence[FaultRecord], bound_s: float) -> Fates:
    """Sort every request by how it ended; any that ended later than ``bound_s`` after it was
    sent (or not at all) is hung, whatever its outcome."""
    out = Fates()
    ends = [r.ended for r in requests if r.ended is not None]
    windows = restart_windows(faults, max(ends, default=0.0))
    for request in requests:
        if request.ended is None or request.ended - request.sent > bound_s or request.outcome == TIMED_OUT:
            out.hung.append(request)
        elif request.outcome == COMPLETED:
            out.completed.append(request)
        elif request.outcome == DISCONNECTED:
            out.disconnected.append(request)
        elif any(lo <= request.ended and request.sent <= hi for lo, hi in windows.get(request.server, [])):
            out.refused_in_restart.append(request)
        elif request.outcome == REFUSED:
            out.refused.append(request)
        else:
            assert request.outcome == FAILED, request.outcome
            out.failed.append(request)
    return out


# --- the pool's hit rate -----------------------------------------------------------------------
def counter_increments(samples: Iterable[MetricsSample], name: str) -> list[tuple[float, float]]:
    """(time, increment since the same server generation's previous sample) of counter ``name``."""
    last: dict[tuple[int, int], float] = {}
    out = []
    for sample in sorted(samples, key=lambda s: s.t):
        key = (sample.server, sample.generation)
        value = sample.series.get(name, 0.0)
        if key in last:
            out.append((sample.t, max(0.0, value - last[key])))
        last[key] = value
    return out


def loaded_blocks(samples: Sequence[MetricsSample], start: float, end: float) -> float:
    """Blocks the servers loaded from the pool (every group's, summed), counted by the samples
    taken from ``start`` to ``end``."""
    names = {
        name
        for sample in samples
        for name in sample.series
        if name.startswith(TRANSFER_BLOCKS_PREFIX) and 'operation="load"' in name
    }
    return sum(value for name in names for t, value in counter_increments(samples, name) if start <= t <= end)


def hit_rate_timeline(samples: Sequence[MetricsSample], window_s: float) -> list[tuple[float, float | None]]:
    """The fleet's pool hit rate per window of ``window_s`` (end time, rate; None: nothing looked up)."""
    hits = counter_increments(samples, HIT_TOKENS)
    queries = counter_increments(samples, QUERY_TOKENS)
    if not queries:
        return []
    last = max(t for t, _ in queries)
    buckets = int(last // window_s) + 1
    hit_sum = [0.0] * buckets
    query_sum = [0.0] * buckets
    for t, value in hits:
        hit_sum[int(t // window_s)] += value
    for t, value in queries:
        query_sum[int(t // window_s)] += value
    return [
        ((i + 1) * window_s, hit_sum[i] / query_sum[i] if query_sum[i] > 0 else None) for i in range(buckets)
    ]


def recovery_seconds(
    fault: FaultRecord,
    timeline: Sequence[tuple[float, float | None]],
    window_s: float,
    *,
    others: Sequence[FaultRecord] = (),
    baseline_s: float = 60.0,
    fraction: float = 0.5,
) -> float | None:
    """Seconds from the end of the fault's episode to the end of the first window after it whose
    hit rate is back to ``fraction`` of the rate before the fault (windows within
    ``baseline_s`` before its start): an upper bound, to a window's width. The episode ends
    when the fault and every fault of ``others`` that began before the rate came back have
    ended (the pool cannot heal while another fault holds it down). None when there was no
    rate before the fault to come back to; ``inf`` when it never came back."""
    before = [
        r for end, r in timeline if fault.started - baseline_s < end - window_s and end <= fault.started
    ]
    rates = [r for r in before if r is not None]
    if not rates or statistics.mean(rates) <= 0:
        return None
    level = fraction * statistics.mean(rates)
    start = fault.ended if fault.ended is not None else fault.started
    while True:
        back = next(
            (end for end, rate in timeline if end > start and rate is not None and rate >= level), None
        )
        until = math.inf if back is None else back
        holding = [
            f.ended if f.ended is not None else math.inf
            for f in others
            if f is not fault and f.started < until and (f.ended is None or f.ended > start)
        ]
        if not holding:
            return math.inf if back is None else back - start
        start = max(holding)
        if math.isinf(start):
            return math.inf


# --- processes ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Growth:
    """Allowed growth of a process generation after warm-up, over its first level."""

    rss_fraction: float = 0.25
    rss_bytes: int = 256 << 20
    threads: int = 8
    fds: int = 32


def leaks(samples: Iterable[ProcSample], warmup_s: float, allowed: Growth = Growth()) -> list[str]:
    """Server generations whose RSS, threads or fds grew past ``allowed`` after warm-up: the
    median of the first three samples after warm-up against the median of the last three."""
    by_generation: dict[tuple[int, int], list[ProcSample]] = defaultdict(list)
    for sample in sorted(samples, key=lambda s: s.t):
        by_generation[(sample.server, sample.generation)].append(sample)
    problems = []
    for (server, generation), series in sorted(by_generation.items()):
        born = series[0].t
        settled = [s for s in series if s.t >= born + warmup_s]
        if len(settled) < 6:
            continue
        head, tail = settled[:3], settled[-3:]

        def median(values: list[ProcSample], attribute: str) -> float:
            return statistics.median(getattr(s, attribute) for s in values)

        rss0, rss1 = median(head, "rss_bytes"), median(tail, "rss_bytes")
        where = f"server {server} generation {generation}"
        if rss1 > rss0 * (1 + allowed.rss_fraction) + allowed.rss_bytes:
            problems.append(f"{where}: RSS {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB")
        for attribute, limit in (("threads", allowed.threads), ("fds", allowed.fds)):
            first, last = median(head, attribute), median(tail, attribute)
            if last > first + limit:
                problems.append(f"{where}: {attribute} {first:.0f} -> {last:.0f}")
    return problems


# --- metrics against the history ----------------------------------------------------------------
def failure_counts(samples: Iterable[MetricsSample]) -> dict[str, float]:
    """``vllm:kvpool_failures_total`` by reason, summed over every server generation's last sample."""
    last: dict[tuple[int, int], MetricsSample] = {}
    for sample in sorted(samples, key=lambda s: s.t):
        last[(sample.server, sample.generation)] = sample
    out: dict[str, float] = defaultdict(float)
    for sample in last.values():
        for name, value in sample.series.items():
            if name.startswith(FAILURES_PREFIX + "{"):
                reason = name.split('reason="', 1)[1].split('"', 1)[0]
                out[reason] += value
    return dict(out)


def metrics_disagreements(history: History, *, final_generations: Mapping[int, int]) -> list[str]:
    """Where the servers' counters disagree with the history (``final_generations``: each
    server's generation at the end; only those were scraped after their last request)."""
    problems = []
    last: dict[tuple[int, int], MetricsSample] = {}
    first: dict[tuple[int, int], MetricsSample] = {}
    for sample in sorted(history.metrics, key=lambda s: s.t):
        last[(sample.server, sample.generation)] = sample
        first.setdefault((sample.server, sample.generation), sample)
    for server, generation in final_generations.items():
        key = (server, generation)
        if key not in last:
            problems.append(f"server {server} generation {generation}: never scraped")
            continue
        counted = last[key].series.get(FINISHED_LENGTH, 0.0) - first[key].series.get(FINISHED_LENGTH, 0.0)
        born = first[key].t
        ended_here = [
            r for r in history.requests if r.server == server and r.ended is not None and r.ended >= born
        ]
        completed = sum(r.outcome == COMPLETED for r in ended_here)
        # Surely counted between the scrapes: the completed requests sent after the first one.
        # One the server finished just before it may reach its client just after.
        surely = sum(r.outcome == COMPLETED and r.sent >= born for r in ended_here)
        # A client that hung up after its last token was generated finished on the server.
        hung_up = sum(r.outcome == DISCONNECTED for r in ended_here)
        if not surely <= counted <= completed + hung_up:
            problems.append(
                f"server {server} generation {generation}: {counted:.0f} requests finished on /metrics, "
                f"{completed} completed in the history ({surely} sent after its first scrape, "
                f"{hung_up} hung up)"
            )
    failures = failure_counts(history.metrics)
    # A reason's series at 0 counted nothing: the connector exports every reason from the start.
    unknown = sorted(reason for reason, n in failures.items() if n and reason not in KNOWN_FAILURE_REASONS)
    if unknown:
        problems.append(f"unknown failure reasons on /metrics: {unknown}")
    outages = [f for f in history.faults if f.kind in POOL_OUTAGES and f.error is None]
    if outages and not sum(failures.values()):
        problems.append(f"{len(outages)} pool outages under traffic, no failure on /metrics")
    return problems


# --- per kind ----------------------------------------------------------------------------------
@dataclass
class KindVerdict:
    """One fault kind's row of the report."""

    kind: str
    count: int
    wrong: int
    hung: int
    refused: int
    recoveries: list[float]  # seconds; inf: not recovered
    unjudged: int  # no hit rate before the fault to come back to

    @property
    def recovery_p50(self) -> float | None:
        return statistics.median(self.recoveries) if self.recoveries else None

    @property
    def recovery_max(self) -> float | None:
        return max(self.recoveries) if self.recoveries else None


def by_kind(
    history: History,
    verdict: Fates,
    wrong: Sequence[RequestRecord],
    timeline: Sequence[tuple[float, float | None]],
    window_s: float,
    *,
    fraction: float = 0.5,
) -> list[KindVerdict]:
    """Per fault kind: its faults, and the wrong, hung and refused requests sent while one of
    that kind held (from its start to its end plus ``window_s``)."""
    kinds: dict[str, list[FaultRecord]] = defaultdict(list)
    for fault in history.faults:
        kinds[fault.kind].append(fault)
    refused = verdict.refused + verdict.refused_in_restart

    def during(requests: Iterable[RequestRecord], faults: list[FaultRecord]) -> int:
        return sum(
            1
            for r in requests
            if any(f.started <= r.sent <= (f.ended or math.inf) + window_s for f in faults)
        )

    rows = []
    for kind, faults in sorted(kinds.items()):
        recoveries = [
            recovery_seconds(f, timeline, window_s, others=history.faults, fraction=fraction) for f in faults
        ]
        rows.append(
            KindVerdict(
                kind,
                len(faults),
                during(wrong, faults),
                during(verdict.hung, faults),
                during(refused, faults),
                [r for r in recoveries if r is not None],
                sum(r is None for r in recoveries),
            )
        )
    return rows
