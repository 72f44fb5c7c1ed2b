"""The operator's Prometheus collectors (names in ``metric_names``), one registry per run,
and the endpoint that serves them (kopf serves the liveness endpoint itself).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.aiohttp import make_aiohttp_handler
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvpool.operator.metric_names import (
    API_WRITES,
    CONSUMER_HIT_GAUGES,
    CONSUMERS,
    CONSUMERS_ROLLED_OUT,
    EMBEDDED,
    EXTERNAL,
    GRANT_HIT_GAUGES,
    MANAGED,
    OBSERVED_GRANT_GAUGES,
    OBSERVED_POOL_GAUGES,
    POOL_CONDITION,
    POOL_INFO,
    POOL_PHASE,
    POOL_STORE_DRAIN,
    POOLS,
    RECONCILE_DURATION,
    RECONCILE_ERRORS,
    RECONCILES,
    MetricSpec,
)
from kvpool.operator.names import ApiResource
from kvpool.operator.spec import CONDITION_TYPES, OBSERVED

METRICS_PATH = "/metrics"


def _counter(spec: MetricSpec, registry: CollectorRegistry) -> Counter:
    return Counter(spec.name, spec.help, spec.labels, registry=registry)


def _gauge(spec: MetricSpec) -> GaugeMetricFamily:
    return GaugeMetricFamily(spec.name, spec.help, labels=list(spec.labels))


class _PoolCollector(Collector):
    """Gauges computed at scrape time from the pools' last known status."""

    def __init__(self, metrics: OperatorMetrics):
        self._metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        pools = _gauge(POOLS)
        counts = {(kind, status): 0 for kind in CONDITION_TYPES for status in ("True", "False", "Unknown")}
        for conditions in self._metrics.conditions.values():
            for kind, status in conditions.items():
                counts[(kind, status)] = counts.get((kind, status), 0) + 1
        for (kind, status), count in sorted(counts.items()):
            pools.add_metric([kind, status], count)
        yield pools
        per_pool = _gauge(POOL_CONDITION)
        for (namespace, pool), conditions in sorted(self._metrics.conditions.items()):
            for kind, status in sorted(conditions.items()):
                per_pool.add_metric([namespace, pool, kind, status], 1)
        yield per_pool
        for spec, index in ((CONSUMERS, 0), (CONSUMERS_ROLLED_OUT, 1)):
            family = _gauge(spec)
            for (namespace, pool), values in sorted(self._metrics.consumers.items()):
                family.add_metric([namespace, pool], values[index])
            yield family
        info = _gauge(POOL_INFO)
        for (namespace, pool), mode in sorted(self._metrics.modes.items()):
            info.add_metric([namespace, pool, mode], 1)
        yield info
        phases = _gauge(POOL_PHASE)
        for (namespace, pool), phase in sorted(self._metrics.phases.items()):
            phases.add_metric([namespace, pool, phase], 1)
        yield phases
        drains = _gauge(POOL_STORE_DRAIN)
        for (namespace, pool), state in sorted(self._metrics.drains.items()):
            drains.add_metric([namespace, pool, state], 1)
        yield drains
        for index, spec in enumerate(OBSERVED_POOL_GAUGES):
            family = _gauge(spec)
            for (namespace, pool), numbers in sorted(self._metrics.capacity.items()):
                value = numbers[index]
                if value is not None:
                    family.add_metric([namespace, pool], value)
            yield family
        yield from _per_item(OBSERVED_GRANT_GAUGES, self._metrics.grants)
        yield from _per_item(CONSUMER_HIT_GAUGES, self._metrics.hits)
        yield from _per_item(GRANT_HIT_GAUGES, self._metrics.grant_hits)


def _per_item(
    specs: tuple[MetricSpec, ...], by_pool: Mapping[tuple[str, str], Mapping[str, tuple[int, ...]]]
) -> Iterator[GaugeMetricFamily]:
    """One gauge per spec of ``specs``, with a series per pool and item (a grant, a consumer):
    the spec's number, by position in the item's numbers."""
    for index, spec in enumerate(specs):
        family = _gauge(spec)
        for (namespace, pool), items in sorted(by_pool.items()):
            for item, numbers in sorted(items.items()):
                family.add_metric([namespace, pool, item], numbers[index])
        yield family


class OperatorMetrics:
    """The collectors of one running operator."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.conditions: dict[tuple[str, str], dict[str, str]] = {}
        self.consumers: dict[tuple[str, str], tuple[int, int]] = {}
        self.phases: dict[tuple[str, str], str] = {}
        self.modes: dict[tuple[str, str], str] = {}  # ``pool_mode`` of each pool's spec
        self.drains: dict[tuple[str, str], str] = {}  # the state of a drain that waits
        # capacity, used, objects, stores mounted, stores expected (``OBSERVED_POOL_GAUGES``)
        self.capacity: dict[tuple[str, str], tuple[int | None, ...]] = {}
        # grant -> used, quota, rejected writes (``OBSERVED_GRANT_GAUGES``), while the master answers
        self.grants: dict[tuple[str, str], dict[str, tuple[int, int, int]]] = {}
        # consumer -> hit tokens, looked-up tokens (``CONSUMER_HIT_GAUGES``), from status.hits
        self.hits: dict[tuple[str, str], dict[str, tuple[int, int]]] = {}
        # grant -> hit tokens, looked-up tokens (``GRANT_HIT_GAUGES``) of its consumers that answered
        self.grant_hits: dict[tuple[str, str], dict[str, tuple[int, int]]] = {}
        self.reconciles = _counter(RECONCILES, self.registry)
        self.errors = _counter(RECONCILE_ERRORS, self.registry)
        self.writes = _counter(API_WRITES, self.registry)
        self.duration = Histogram(
            RECONCILE_DURATION.name,
            RECONCILE_DURATION.help,
            RECONCILE_DURATION.labels,
            buckets=RECONCILE_DURATION.buckets,
            registry=self.registry,
        )
        self.registry.register(_PoolCollector(self))

    def count_write(self, verb: str, resource: ApiResource) -> None:
        self.writes.labels(verb, resource.plural).inc()

    def observe_pool(
        self, namespace: str, pool: str, status: Mapping[str, Any], mode: str | None = None
    ) -> None:
        """Remember a pool's conditions and consumer counts from its status, and its ``mode``
        (``pool_mode`` of its spec; None: the mode last observed)."""
        if mode is not None:
            self.modes[(namespace, pool)] = mode
        self.conditions[(namespace, pool)] = {c["type"]: c["status"] for c in status.get("conditions") or []}
        consumers = status.get("consumers") or []
        rolled_out = sum(1 for c in consumers if c.get("rolledOut"))
        self.consumers[(namespace, pool)] = (len(consumers), rolled_out)
        self.phases[(namespace, pool)] = str(status.get("phase", "Pending"))
        drain = status.get("storeDrain")
        if isinstance(drain, Mapping) and drain.get("state"):
            self.drains[(namespace, pool)] = str(drain["state"])
        else:
            self.drains.pop((namespace, pool), None)
        capacity = status.get("capacity")
        if isinstance(capacity, Mapping):
            self.capacity[(namespace, pool)] = tuple(
                capacity.get(key)
                for key in ("capacityBytes", "usedBytes", "objects", "storesMounted", "storesExpected")
            )
        else:
            self.capacity.pop((namespace, pool), None)
        self.grants[(namespace, pool)] = grant_numbers(status)
        self.hits[(namespace, pool)] = consumer_hit_numbers(status)
        self.grant_hits[(namespace, pool)] = grant_hit_numbers(status)

    def forget_pool(self, namespace: str, pool: str) -> None:
        self.conditions.pop((namespace, pool), None)
        self.consumers.pop((namespace, pool), None)
        self.phases.pop((namespace, pool), None)
        self.modes.pop((namespace, pool), None)
        self.drains.pop((namespace, pool), None)
        self.capacity.pop((namespace, pool), None)
        self.grants.pop((namespace, pool), None)
        self.hits.pop((namespace, pool), None)
        self.grant_hits.pop((namespace, pool), None)


def pool_mode(spec: Mapping[str, Any] | None) -> str:
    """A pool's mode as ``POOL_INFO`` names it: external (``spec.external``, whatever its store
    mode), embedded (``spec.store.mode``) or managed."""
    spec = spec or {}
    if spec.get("external") is not None:
        return EXTERNAL
    store = spec.get("store")
    if isinstance(store, Mapping) and store.get("mode") == "embedded":
        return EMBEDDED
    return MANAGED


def grant_numbers(status: Mapping[str, Any]) -> dict[str, tuple[int, int, int]]:
    """Each grant's used bytes, quota and rejected writes from a pool's ``status.capacity.grants``;
    none unless the master answered the last poll (``Observed`` True): kept numbers of a master
    that no longer answers are not exported, nor a grant whose tenant it does not know."""
    observed = any(
        c.get("type") == OBSERVED and c.get("status") == "True" for c in status.get("conditions") or []
    )
    capacity = status.get("capacity")
    if not observed or not isinstance(capacity, Mapping):
        return {}
    out = {}
    for item in capacity.get("grants") or []:
        numbers = (item.get("usedBytes"), item.get("quotaBytes"), item.get("rejectedWrites"))
        if all(isinstance(n, int) for n in numbers):
            out[str(item.get("grant"))] = numbers
    return out


@asynccontextmanager
async def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> AsyncIterator[None]:
    """Serve the registry on ``http://host:port/metrics`` until the block exits."""
    app = web.Application()
    app.router.add_get(METRICS_PATH, make_aiohttp_handler(registry))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        yield
    finally:
        await runner.cleanup()


def consumer_hit_numbers(status: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """Each consumer's hit and looked-up tokens from a pool's ``status.hits``; a consumer none
    of whose pods answered has no numbers (unknown, not zero)."""
    return {str(item.get("name")): numbers for item, numbers in _answered_consumers(status)}


def grant_hit_numbers(status: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """Each grant's hit and looked-up tokens from a pool's ``status.hits``: its consumers that
    answered, summed; a grant none of whose consumers answered has no numbers (unknown, not zero)."""
    out: dict[str, tuple[int, int]] = {}
    for item, (hit, looked_up) in _answered_consumers(status):
        if grant := item.get("grant"):
            before = out.get(str(grant), (0, 0))
            out[str(grant)] = (before[0] + hit, before[1] + looked_up)
    return out


def _answered_consumers(status: Mapping[str, Any]) -> Iterator[tuple[Mapping[str, Any], tuple[int, int]]]:
    """The entries of ``status.hits.consumers`` some pod of which answered, with their numbers."""
    hits = status.get("hits")
    if not isinstance(hits, Mapping):
        return
    for item in hits.get("consumers") or []:
        numbers = (item.get("hitTokens"), item.get("lookedUpTokens"))
        answered = str(item.get("pods", "0/")).split("/", 1)[0]
        if all(isinstance(n, int) for n in numbers) and answered not in ("", "0"):
            yield item, (int(numbers[0]), int(numbers[1]))
