"""Connector stats the way vLLM carries them: worker → scheduler → Prometheus.

Records become a plain, serialisable ``{"counters": {key: n}, "histograms":
{key: [obs...]}, "gauges": {key: value}}`` payload (``key`` = metric name plus label pairs), which
``PoolConnectorStats`` aggregates across workers and steps and
``PoolPromMetrics`` turns into series on vLLM's own ``/metrics``. A worker's payload also carries
its ranks' bytes of each transfer (``RANK_BYTES``), which the scheduler joins into one
observation per transfer (``TransferSizes``) once every rank reported it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvpool.connector.contract import metric_names as m
from kvpool.connector.contract.settings import ConnectorSettings, SettingsError
from kvpool.connector.observability.records import LookupRecord, TransferRecord
from kvpool.connector.pool_client import FAILURE_OUTCOMES, Outcome
from kvpool.connector.scheduler.load_decision import VERDICT_LABELS

SEP = "|"
MAX_OBSERVATIONS = 4096  # per histogram series and interval; beyond, the oldest go
#: The payload part of the workers' bytes per transfer and rank: ``{"<operation>|<request id>":
#: [[rank, bytes, attempted], ...]}``. No series exports it: the scheduler takes it out of the
#: workers' payload (``TransferSizes``) before vLLM passes that on.
RANK_BYTES = "rank_bytes"
MAX_PENDING_TRANSFERS = 4096  # transfers some rank has not reported yet; beyond, the oldest go


def series_key(spec: m.MetricSpec, **labels: object) -> str:
    """``name|label=value|...`` with labels in the spec's order."""
    return _series_key(spec, tuple(labels[name] for name in spec.labels))


@lru_cache(maxsize=4096)
def _series_key(spec: m.MetricSpec, values: tuple[object, ...]) -> str:
    return SEP.join([spec.name, *(f"{name}={value}" for name, value in zip(spec.labels, values))])


def fingerprint_info_key(inputs: Mapping[str, str]) -> str:
    """The series key of ``vllm:kvpool_key_fingerprint_info`` for the fingerprint's inputs."""
    values = {name: str(inputs.get(name, "")).replace(SEP, "/") for name in m.KEY_FINGERPRINT_INFO.labels}
    return series_key(m.KEY_FINGERPRINT_INFO, **values)


def in_pool_gauge(in_pool: bool) -> dict[str, float]:
    """The ``gauges`` entry of ``vllm:kvpool_in_pool``."""
    return {series_key(m.IN_POOL): 1.0 if in_pool else 0.0}


def parse_key(key: str) -> tuple[str, tuple[str, ...]]:
    """(metric name, label values) of a series key."""
    name, *pairs = key.split(SEP)
    return name, tuple(pair.split("=", 1)[1] for pair in pairs)


#: Per group and operation: the counters each transfer of the group adds to.
_GROUP_TRANSFER_COUNTERS = (m.TRANSFER_BLOCKS, m.TRANSFER_BYTES, m.TRANSFER_KEYS, m.MASKED_BLOCKS)


def zero_series(group_kinds: Sequence[str] = ()) -> list[str]:
    """Series keys of the counters whose label values are known before their first event, to
    export at 0: ``rate()`` and the alerts then see that first event, and the dashboards read 0,
    not "No data".

    The counters without labels of ours, every reason a lookup may fail for, every load
    decision; with the engine's KV-cache groups (``group_kinds``, by group index), each group's
    hits, its loads' and saves' blocks, bytes, keys and failures (every reason), and the
    corrupt objects removed. Not the layout mismatches (one series per field that differs),
    nor gauges (0 says something) or histograms.
    """
    reasons = [outcome.value for outcome in FAILURE_OUTCOMES]
    keys = [series_key(spec) for spec in m.ALL if spec.kind is m.Kind.COUNTER and not spec.labels]
    all_groups = {"group": m.ALL_GROUPS_KIND, "group_kind": m.ALL_GROUPS_KIND}
    keys += [series_key(m.FAILURES, operation=m.LOOKUP, reason=r, **all_groups) for r in reasons]
    keys += [series_key(m.LOAD_DECISIONS, decision=d, basis=b) for d, b in VERDICT_LABELS]
    for g, kind in enumerate(group_kinds):
        group = {"group": g, "group_kind": kind}
        keys += [series_key(spec, **group) for spec in (m.GROUP_HIT_TOKENS, m.PRESENT_BLOCKS, m.HIT_BLOCKS)]
        for op in (m.LOAD, m.SAVE):
            keys += [series_key(spec, operation=op, **group) for spec in _GROUP_TRANSFER_COUNTERS]
            keys += [series_key(m.FAILURES, operation=op, reason=r, **group) for r in reasons]
        keys.append(series_key(m.REMOVED_OBJECTS, reason=Outcome.CORRUPT.value, **group))
    return keys


def declared_group_kinds(vllm_config: Any) -> tuple[str, ...]:
    """The group kinds of the KV layout the connector's settings declare (the operator declares
    one for each consumer it configures); none without one, or without valid settings (the
    connector says why when it starts)."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is None:
        return ()
    try:
        settings = ConnectorSettings.from_sources(transfer.kv_connector_extra_config)
    except SettingsError:
        return ()
    layout = settings.declared_layout
    return () if layout is None else tuple(group.kind.value for group in layout.groups)


class _Payload:
    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.histograms: dict[str, list[float]] = {}
        self.rank_bytes: dict[str, list[list[float]]] = {}

    def inc(self, spec: m.MetricSpec, value: float, **labels: object) -> None:
        if value:
            key = series_key(spec, **labels)
            self.counters[key] = self.counters.get(key, 0.0) + value

    def observe(self, spec: m.MetricSpec, *values: float, **labels: object) -> None:
        self.histograms.setdefault(series_key(spec, **labels), []).extend(values)

    def data(self) -> dict[str, Any]:
        out: dict[str, Any] = {"counters": self.counters, "histograms": self.histograms}
        if self.rank_bytes:
            out[RANK_BYTES] = self.rank_bytes
        return out


#: Payload counters no series exports: the loads the load rate learns from, those that
#: failed nowhere (a failed load's time measures the fault, not the link).
CLEAN_LOAD_BYTES = "clean_load_bytes"  # every rank's
CLEAN_LOAD_SECONDS = "clean_load_seconds"  # rank 0's, summed over each load's groups
#: Per group, every rank's bytes of saved blocks the pool already held (none of them moved): the
#: block size the load rate learns counts them, whichever ranks held their keys and which wrote.
HELD_BYTES = "held_bytes"


def records_to_data(lookups: Iterable[LookupRecord], transfers: Iterable[TransferRecord]) -> dict[str, Any]:
    """The stats payload for a batch of records."""
    out = _Payload()
    _add_lookups(out, lookups)
    for t in transfers:
        op = t.operation
        if op == m.LOAD and not t.failures and any(t.bytes):
            out.counters[CLEAN_LOAD_BYTES] = out.counters.get(CLEAN_LOAD_BYTES, 0.0) + sum(t.bytes)
            if not t.rank:
                seconds = sum(s for s, tried in zip(t.group_seconds, t.group_attempted) if tried)
                out.counters[CLEAN_LOAD_SECONDS] = out.counters.get(CLEAN_LOAD_SECONDS, 0.0) + seconds
        if op == m.REMOVE:
            for g, kind in enumerate(t.group_kinds):
                out.inc(m.REMOVED_OBJECTS, t.blocks[g], group=g, group_kind=kind, reason=t.reason)
            continue
        # Every rank's keys: its own (its shard's), so each rank counts its bytes, the keys it
        # moved and those that failed. The blocks, masks and latencies are the same on every
        # rank: rank 0 counts them.
        for g, kind in enumerate(t.group_kinds):
            labels = {"group": g, "group_kind": kind, "operation": op}
            out.inc(m.TRANSFER_BYTES, t.bytes[g], **labels)
            if t.held_bytes and t.held_bytes[g]:
                key = f"{HELD_BYTES}{SEP}group={g}"
                out.counters[key] = out.counters.get(key, 0.0) + t.held_bytes[g]
            out.inc(m.TRANSFER_KEYS, t.blocks[g], **labels)
            for reason, count in t.group_failures[g].items():
                out.inc(m.FAILURES, count, reason=reason, **labels)
        if t.rank is None:  # the whole engine's view: its bytes are the request's
            if any(t.group_attempted):
                out.observe(m.TRANSFER_SIZE_BYTES, float(sum(t.bytes)), operation=op)
        else:  # one rank's share of the request's bytes: the scheduler adds up the ranks'
            entry = [float(t.rank), float(sum(t.bytes)), 1.0 if any(t.group_attempted) else 0.0]
            out.rank_bytes.setdefault(f"{op}{SEP}{t.req_id}", []).append(entry)
        if t.rank:  # another rank of the same blocks
            continue
        for g, kind in enumerate(t.group_kinds):
            labels = {"group": g, "group_kind": kind, "operation": op}
            out.inc(m.TRANSFER_BLOCKS, t.blocks[g], **labels)
            out.inc(m.MASKED_BLOCKS, t.masked[g], **labels)
            if t.group_attempted[g]:
                out.observe(m.OPERATION_SECONDS, t.group_seconds[g], operation=op, group_kind=kind)
        if t.rank is None:  # a worker's view is partial: the scheduler counts the union
            out.inc(m.LOAD_ERROR_BLOCKS, t.load_error_blocks)
            out.inc(m.RECOMPUTED_REQUESTS, int(t.recomputed))
    return out.data()


def _add_lookups(out: _Payload, lookups: Iterable[LookupRecord]) -> None:
    """Lookup counters summed over the batch first (a step admits many requests), then added."""
    count = query_tokens = hit_tokens = deferred_steps = 0
    per_group: dict[tuple[int, str], list[int]] = {}  # (group, kind) -> [group hit, present, hit blocks]
    failures: dict[str, int] = {}
    seconds = []
    for r in lookups:
        count += 1
        query_tokens += r.query_tokens
        hit_tokens += r.hit_tokens
        deferred_steps += r.deferred_steps
        # Each per-group sequence read once (a statistic may be computed on its first read).
        counted_needed = r.needed_blocks if r.hit_tokens else (0,) * len(r.group_kinds)
        for g, (kind, group_hit, present, needed) in enumerate(
            zip(r.group_kinds, r.group_hit_tokens, r.present_blocks, counted_needed)
        ):
            sums = per_group.setdefault((g, kind), [0, 0, 0])
            sums[0] += group_hit
            sums[1] += present
            sums[2] += needed
        if r.timed:
            seconds.append(r.seconds)
        for reason, n in r.failures.items():
            failures[reason] = failures.get(reason, 0) + n
    if not count:
        return
    out.inc(m.LOOKUPS, count)
    out.inc(m.LOOKUP_QUERY_TOKENS, query_tokens)
    out.inc(m.LOOKUP_HIT_TOKENS, hit_tokens)
    out.inc(m.LOOKUP_DEFERRED_STEPS, deferred_steps)
    for (g, kind), (group_hit, present, hit_blocks) in per_group.items():
        out.inc(m.GROUP_HIT_TOKENS, group_hit, group=g, group_kind=kind)
        out.inc(m.PRESENT_BLOCKS, present, group=g, group_kind=kind)
        out.inc(m.HIT_BLOCKS, hit_blocks, group=g, group_kind=kind)
    if seconds:
        out.observe(m.OPERATION_SECONDS, *seconds, operation=m.LOOKUP, group_kind=m.ALL_GROUPS_KIND)
    all_groups = {"group": m.ALL_GROUPS_KIND, "group_kind": m.ALL_GROUPS_KIND}
    for reason, n in failures.items():
        out.inc(m.FAILURES, n, operation=m.LOOKUP, reason=reason, **all_groups)


@dataclass
class TransferSample:
    """What one step's worker stats say about transfers, for the scheduler's load rates."""

    # Loads that failed nowhere: every rank's bytes; rank 0's seconds, summed over each
    # load's groups (they load in turn).
    load_bytes: float = 0.0
    load_seconds: float = 0.0
    # Loads and saves, every rank's, those of blocks a save found held included (none moved).
    group_bytes: dict[int, float] = field(default_factory=dict)
    group_blocks: dict[int, float] = field(default_factory=dict)  # loads and saves, rank 0's


def transfer_sample(data: Mapping[str, Any]) -> TransferSample:
    """The transfers in a stats payload (the workers' records, as :func:`records_to_data` wrote them)."""
    counters = data.get("counters", {})
    sample = TransferSample(counters.get(CLEAN_LOAD_BYTES, 0.0), counters.get(CLEAN_LOAD_SECONDS, 0.0))
    for key, value in counters.items():
        name, labels = parse_key(key)
        if name in (m.TRANSFER_BYTES.name, m.TRANSFER_BLOCKS.name):
            group, _, operation = labels
            if operation in (m.LOAD, m.SAVE):
                into = sample.group_bytes if name == m.TRANSFER_BYTES.name else sample.group_blocks
                into[int(group)] = into.get(int(group), 0.0) + value
        elif name == HELD_BYTES:
            held = int(labels[0])
            sample.group_bytes[held] = sample.group_bytes.get(held, 0.0) + value
    return sample


def decision_data(
    decisions: Mapping[tuple[str, str], int],
    skipped_tokens: int,
    load_rates: Mapping[str, float] | None,
    prefill_rate: float | None,
) -> dict[str, Any]:
    """The stats payload of the scheduler's load decisions and the rates they used
    (``load_rates``/``prefill_rate`` None: unchanged, not exported)."""
    out = _Payload()
    for (decision, basis), count in decisions.items():
        out.inc(m.LOAD_DECISIONS, count, decision=decision, basis=basis)
    out.inc(m.LOAD_SKIPPED_TOKENS, skipped_tokens)
    gauges: dict[str, float] = {}
    for transport, rate in (load_rates or {}).items():
        gauges[series_key(m.LOAD_RATE, transport=transport)] = rate
    if prefill_rate is not None:
        gauges[series_key(m.PREFILL_RATE)] = prefill_rate
    return {**out.data(), "gauges": gauges}


def merge_data(first: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, Any]:
    """Two stats payloads as one (counters added, observations joined, the second's gauges last)."""
    merged = PoolConnectorStats(data=dict(first)).aggregate(PoolConnectorStats(data=dict(second)))
    return merged.data


@dataclass
class PoolConnectorStats(KVConnectorStats):
    """Aggregatable, serialisable counters and observations of KVPoolConnector."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"counters": {}, "histograms": {}, "gauges": {}}

    def is_empty(self) -> bool:
        return not any(self.data.get(part) for part in ("counters", "histograms", "gauges", RANK_BYTES))

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        counters: dict[str, float] = dict(self.data.get("counters", {}))
        for key, value in other.data.get("counters", {}).items():
            counters[key] = counters.get(key, 0.0) + value
        histograms: dict[str, list[float]] = {k: list(v) for k, v in self.data.get("histograms", {}).items()}
        for key, values in other.data.get("histograms", {}).items():
            merged = histograms.setdefault(key, [])
            merged.extend(values)
            del merged[:-MAX_OBSERVATIONS]
        gauges = {**self.data.get("gauges", {}), **other.data.get("gauges", {})}  # the latest value
        data: dict[str, Any] = {"counters": counters, "histograms": histograms, "gauges": gauges}
        # The workers' ranks of each transfer, side by side (the scheduler joins them).
        rank_bytes = {k: list(v) for k, v in self.data.get(RANK_BYTES, {}).items()}
        for key, entries in other.data.get(RANK_BYTES, {}).items():
            rank_bytes.setdefault(key, []).extend(entries)
        if rank_bytes:
            data[RANK_BYTES] = rank_bytes
        return PoolConnectorStats(data=data)

    def counter(self, spec: m.MetricSpec) -> float:
        """Sum of one counter over all its label sets."""
        return sum(v for k, v in self.data.get("counters", {}).items() if parse_key(k)[0] == spec.name)

    def reduce(self) -> dict[str, int | float]:
        """A one-line summary for vLLM's periodic log."""
        queried = self.counter(m.LOOKUP_QUERY_TOKENS)
        hit = self.counter(m.LOOKUP_HIT_TOKENS)
        return {
            "lookups": int(self.counter(m.LOOKUPS)),
            "hit_rate": round(hit / queried, 4) if queried else 0.0,
            "bytes_moved": int(self.counter(m.TRANSFER_BYTES)),
            "failures": int(self.counter(m.FAILURES)),
        }


@dataclass
class _Transfer:
    """One transfer some rank has not reported yet: the ranks' bytes so far."""

    shares: dict[int, float] = field(default_factory=dict)
    attempted: bool = False  # whether any rank had blocks to move


class TransferSizes:
    """The scheduler's join of the workers' bytes per transfer: one observation of
    ``vllm:kvpool_transfer_size_bytes`` per request's load or save, its bytes over every rank.

    Each rank records its own share of a transfer, and the ranks' records reach the scheduler
    in the same step's payload or in later ones (each rank's transfer ends on its own). So the
    shares wait here, by operation and request, until all ``ranks`` reported: a request saved
    in several steps has one transfer per step, and a rank's n-th record of it joins the other
    ranks' n-th. At most ``limit`` transfers wait; beyond, the oldest is dropped unobserved (a
    rank that never reports one: it stopped meanwhile).
    """

    def __init__(self, ranks: int, limit: int = MAX_PENDING_TRANSFERS):
        self.ranks = max(1, ranks)
        self.limit = limit
        self._pending: dict[str, list[_Transfer]] = {}  # "<operation>|<request id>" -> in order
        self._waiting = 0
        self._done: dict[str, list[float]] = {}

    def add(self, stats: KVConnectorStats | None) -> None:
        """Take the workers' shares out of a step's worker payload (vLLM passes the rest on)."""
        if stats is None or not isinstance(stats.data, dict):
            return
        for key, entries in stats.data.pop(RANK_BYTES, {}).items():
            for rank, size, attempted in entries:
                self._join(key, int(rank), size, bool(attempted))

    def _join(self, key: str, rank: int, size: float, attempted: bool) -> None:
        transfers = self._pending.setdefault(key, [])
        transfer = next((t for t in transfers if rank not in t.shares), None)
        if transfer is None:
            transfer = _Transfer()
            transfers.append(transfer)
            self._waiting += 1
        transfer.shares[rank] = size
        transfer.attempted = transfer.attempted or attempted
        if len(transfer.shares) >= self.ranks:
            self._drop(key, transfer)
            if transfer.attempted:
                series = series_key(m.TRANSFER_SIZE_BYTES, operation=key.split(SEP, 1)[0])
                self._done.setdefault(series, []).append(sum(transfer.shares.values()))
        while self._waiting > self.limit:
            oldest = next(iter(self._pending))
            self._drop(oldest, self._pending[oldest][0])

    def _drop(self, key: str, transfer: _Transfer) -> None:
        transfers = self._pending[key]
        transfers.remove(transfer)
        self._waiting -= 1
        if not transfers:
            del self._pending[key]

    def take(self) -> dict[str, list[float]]:
        """The ``histograms`` part of the transfers every rank reported since the last call."""
        done, self._done = self._done, {}
        return done


class PoolPromMetrics(KVConnectorPromMetrics):
    """KVPoolConnector's series, registered with the metric classes vLLM passes."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: Mapping[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, dict(metric_types), labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        for spec in m.ALL:
            names = [*labelnames, *spec.labels]
            if spec.kind is m.Kind.COUNTER:
                metric = self._counter_cls(name=spec.name, documentation=spec.help, labelnames=names)
            elif spec.kind is m.Kind.GAUGE:
                metric = self._gauge_cls(
                    name=spec.name, documentation=spec.help, labelnames=names, multiprocess_mode="mostrecent"
                )
            else:
                metric = self._histogram_cls(
                    name=spec.name, documentation=spec.help, labelnames=names, buckets=list(spec.buckets)
                )
            self._metrics[spec.name] = metric
        # The counters known up front exist from the start, at 0 (the groups: those the settings
        # declare; the scheduler's first stats carry the zeros of the groups vLLM built).
        zeros = [parse_key(key) for key in zero_series(declared_group_kinds(vllm_config))]
        for labelvalues in per_engine_labelvalues.values():
            engine_labels = [str(v) for v in labelvalues]
            for name, labels in zeros:
                self._metrics[name].labels(*engine_labels, *labels)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine_labels = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for key, value in transfer_stats_data.get("counters", {}).items():
            name, labels = parse_key(key)
            metric = self._metrics.get(name)
            if metric is not None:
                child = metric.labels(*engine_labels, *labels)  # a 0 creates the series
                if value:
                    child.inc(value)
        for key, value in transfer_stats_data.get("gauges", {}).items():
            name, labels = parse_key(key)
            metric = self._metrics.get(name)
            if metric is not None:
                metric.labels(*engine_labels, *labels).set(value)
        for key, values in transfer_stats_data.get("histograms", {}).items():
            name, labels = parse_key(key)
            metric = self._metrics.get(name)
            if metric is not None:
                child = metric.labels(*engine_labels, *labels)
                for value in values:
                    child.observe(value)
