"""Metrics and traces say exactly what happened — checked against ground truth.

* stats payloads and Prometheus series from known records (unit);
* spans and their parent links, in the SDK's in-memory exporter;
* a real engine run: every counter equals what the test counts itself, and a
  real Prometheus scraping vLLM's metrics registry answers the per-group hit
  rate and p99 latency queries with those numbers;
* spans over the wire to an OTLP/HTTP receiver, joined to the caller's trace;
* no prompt token ids or block keys in any span, metric label or log line, faults included.
"""

from __future__ import annotations

import bisect
import functools
import logging
import random
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import prometheus_client
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from kvpool.connector.contract import metric_names as m
from kvpool.connector.contract.keys import KeySpace
from kvpool.connector.contract.layout import GroupKind, KVGroup, KVLayout, fingerprint
from kvpool.connector.local.pool import LOOPBACK, free_port
from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestLoad, RequestSave
from kvpool.connector.observability import logs, tracing
from kvpool.connector.observability.records import LookupRecord, StatsCollector, TransferRecord
from kvpool.connector.observability.vllm_metrics import (
    PoolConnectorStats,
    PoolPromMetrics,
    parse_key,
    records_to_data,
    series_key,
    zero_series,
)
from kvpool.connector.pool_client import FAILURE_OUTCOMES
from kvpool.connector.scheduler.load_decision import VERDICT_LABELS
from kvpool.connector.worker.side import WorkerSide
from testing.engine import (
    EngineOptions,
    create_llm,
    engine_core,
    generate,
    run_engine_subprocess,
    scheduler_connector,
    shutdown_llm,
    transfer_config,
    wait_for_saves_here,
    worker_connector,
)
from testing.models import build_gemma3
from testing.mooncake_faults import READ_METHOD, FailingReads, digests_of, mooncake_store_class
from testing.pool_store import bare_client, raw_store
from testing.prompts import MAX_TOKENS, P1, P2, PREFIX_HIT, pool_keys
from testing.services import OTLPReceiver, PrometheusServer
from testing.worker import run_loads

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN}-01"}

_exporter = InMemorySpanExporter()


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    """The process's tracer provider, exporting to memory (installed once)."""
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_exporter))
        trace.set_tracer_provider(provider)
    tracing.configure_from_env({})  # as the connector does at start: the provider is seen now
    _exporter.clear()
    return _exporter


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3(tmp_path_factory.mktemp("gemma3-obs"))


# --- unit: payloads and series -------------------------------------------------------


def _lookup(hit: int) -> LookupRecord:
    return LookupRecord(
        query_tokens=350,
        hit_tokens=hit,
        group_kinds=("sliding_window", "full"),
        looked_up_blocks=(10, 10),
        present_blocks=(9, 9),
        needed_blocks=(2, 9),
        group_hit_tokens=(288, 288),
        seconds=0.003,
        keys=20,
    )


def _load() -> TransferRecord:
    return TransferRecord(
        operation="load",
        group_kinds=("sliding_window", "full"),
        blocks=(2, 8),
        masked=(7, 0),
        bytes=(2 * 1024, 8 * 1024),
        failures={"missing": 1},
        seconds=0.02,
        group_failures=({}, {"missing": 1}),
        group_seconds=(0.005, 0.015),
        group_attempted=(True, True),
        load_error_blocks=0,
        recomputed=True,
    )


def test_payload_aggregates_and_becomes_series() -> None:
    first = PoolConnectorStats(data=records_to_data([_lookup(288)], [_load()]))
    second = PoolConnectorStats(data=records_to_data([_lookup(0)], []))
    total = first.aggregate(second)
    assert total.counter(m.LOOKUPS) == 2
    assert total.counter(m.LOOKUP_HIT_TOKENS) == 288
    assert total.reduce() == {
        "lookups": 2,
        "hit_rate": round(288 / 700, 4),
        "bytes_moved": 10 * 1024,
        "failures": 1,
    }
    assert not total.is_empty() and PoolConnectorStats().is_empty()

    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = PoolPromMetrics(
        SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["tiny", "0"]}
    )
    prom.observe(total.data, 0)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", **labels})

    assert value("vllm:kvpool_lookups_total") == 2
    assert value("vllm:kvpool_group_hit_tokens_total", group="0", group_kind="sliding_window") == 576
    assert value("vllm:kvpool_hit_blocks_total", group="1", group_kind="full") == 9  # only the hit
    assert (
        value("vllm:kvpool_masked_blocks_total", group="0", group_kind="sliding_window", operation="load")
        == 7
    )
    assert (
        value("vllm:kvpool_failures_total", group="1", group_kind="full", operation="load", reason="missing")
        == 1
    )
    assert value("vllm:kvpool_recomputed_requests_total") == 1
    assert value("vllm:kvpool_operation_seconds_count", operation="load", group_kind="full") == 1
    assert value("vllm:kvpool_operation_seconds_count", operation="lookup", group_kind="all") == 2
    assert value("vllm:kvpool_transfer_size_bytes_sum", operation="load") == 10 * 1024


def _exposition(vllm_config: Any, data: dict[str, Any] | None = None) -> dict[tuple[str, frozenset], float]:
    """What ``/metrics`` shows of our series for two engines whose connector just started
    (its first stats, ``data``, observed for engine 0): (sample name, labels) -> value."""
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = PoolPromMetrics(vllm_config, types, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    if data is not None:
        prom.observe(data, 0)
    text = prometheus_client.generate_latest(registry).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("vllm:kvpool_") and not sample.name.endswith("_created")
    }


def _zero_series_expected(engine: str, group_kinds: tuple[str, ...]) -> set[tuple[str, frozenset]]:
    """The counter series a connector exports at 0 from the start, for one engine."""
    vllm = {"model_name": "m", "engine": engine}
    every = [spec.exported for spec in m.ALL if spec.kind is m.Kind.COUNTER and not spec.labels]
    out = {(name, frozenset(vllm.items())) for name in every}

    def add(spec: m.MetricSpec, **labels: object) -> None:
        out.add((spec.exported, frozenset({**vllm, **{k: str(v) for k, v in labels.items()}}.items())))

    for reason in FAILURE_OUTCOMES:
        add(m.FAILURES, group="all", group_kind="all", operation="lookup", reason=reason.value)
    for decision, basis in VERDICT_LABELS:
        add(m.LOAD_DECISIONS, decision=decision, basis=basis)
    for g, kind in enumerate(group_kinds):
        for spec in (m.GROUP_HIT_TOKENS, m.PRESENT_BLOCKS, m.HIT_BLOCKS):
            add(spec, group=g, group_kind=kind)
        for op in ("load", "save"):
            for spec in (m.TRANSFER_BLOCKS, m.TRANSFER_BYTES, m.TRANSFER_KEYS, m.MASKED_BLOCKS):
                add(spec, group=g, group_kind=kind, operation=op)
            for reason in FAILURE_OUTCOMES:
                add(m.FAILURES, group=g, group_kind=kind, operation=op, reason=reason.value)
        add(m.REMOVED_OBJECTS, group=g, group_kind=kind, reason="corrupt")
    return out


def test_a_started_connector_exports_its_known_counters_at_zero() -> None:
    """Before any event, ``/metrics`` holds every counter series whose labels are known up front
    at 0, for every engine: every failure reason of a lookup, every load decision, and per
    KV-cache group of the layout the settings declare its hits, transfers and failures by
    reason. No gauge (0 would say out of the pool), no histogram, no layout mismatch."""
    layout = KVLayout(
        model="m",
        groups=[
            KVGroup(kind=GroupKind.FULL, block_size=32),
            KVGroup(kind=GroupKind.SLIDING_WINDOW, block_size=32, sliding_window=64),
        ],
    )
    extra = {
        "master_server_address": "127.0.0.1:50051",
        "declared_layout": layout.model_dump(mode="json"),
        "declared_layout_fingerprint": fingerprint(layout),
    }
    declared = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    series = _exposition(declared)
    kinds = ("full", "sliding_window")
    expected = _zero_series_expected("0", kinds) | _zero_series_expected("1", kinds)
    assert set(series) == expected
    assert set(series.values()) == {0.0}

    # Without a declared layout the groups are vLLM's to build: none until the scheduler's
    # first stats, which carry them at 0.
    undeclared = SimpleNamespace(kv_transfer_config=None)
    assert set(_exposition(undeclared)) == _zero_series_expected("0", ()) | _zero_series_expected("1", ())
    first = PoolConnectorStats(data={"counters": dict.fromkeys(zero_series(kinds), 0.0)})
    series = _exposition(undeclared, first.data)
    assert set(series) == _zero_series_expected("0", kinds) | _zero_series_expected("1", ())
    assert set(series.values()) == {0.0}


def test_every_metric_name_is_prometheus_valid() -> None:
    names = [spec.exported for spec in m.ALL]
    assert len(set(names)) == len(names)
    for spec in m.ALL:
        assert spec.name.startswith("vllm:kvpool_")
        assert not set(spec.labels) & set(m.VLLM_LABELS)
        if spec.kind is m.Kind.COUNTER:
            assert not spec.name.endswith("_total")
    assert parse_key("vllm:kvpool_x|group=1|group_kind=full") == ("vllm:kvpool_x", ("1", "full"))


# --- spans in memory -----------------------------------------------------------------


def test_worker_spans_join_the_request_trace(spans, pool_client, cache_prefix) -> None:
    import torch

    stats = StatsCollector(group_kinds=("sliding_window", "full"))
    worker = WorkerSide(
        client=pool_client,
        keyspace=KeySpace(cache_prefix, "fp"),
        tp_rank=0,
        pp_rank=0,
        group_layers=[["a"], ["b"]],
        num_blocks=8,
        stats=stats,
    )
    try:
        worker.register_kv_caches({"a": torch.randn(8, 2, 32, 16), "b": torch.randn(8, 2, 32, 16)})
        save = RequestSave("req-s", [GroupTransfer(0, ["x"], [1]), GroupTransfer(1, ["y"], [2])], TRACEPARENT)
        worker.start_saves(PoolConnectorMetadata(saves=[save]))
        worker.before_forward()
        worker.wait_for_saves()
        load = RequestLoad(
            "req-l",
            [GroupTransfer(0, ["x"], [3], masked=4), GroupTransfer(1, ["y", "gone"], [4, 5])],
            hit_tokens=64,
            trace_context=TRACEPARENT,
        )
        run_loads(worker, [load])
    finally:
        worker.shutdown()
    finished = spans.get_finished_spans()
    (load_span,) = [s for s in finished if s.name == "kvpool.load"]
    groups = [s for s in finished if s.name == "kvpool.load.group"]
    assert format(load_span.context.trace_id, "032x") == TRACE_ID
    assert format(load_span.parent.span_id, "016x") == PARENT_SPAN
    assert {g.parent.span_id for g in groups} == {load_span.context.span_id}
    by_group = {g.attributes["kvpool.group"]: g for g in groups}
    assert by_group[0].attributes["kvpool.masked_blocks"] == 4
    assert by_group[0].attributes["kvpool.blocks"] == 1
    assert by_group[1].attributes["kvpool.failures.missing"] == 1
    assert not by_group[1].status.is_ok and not load_span.status.is_ok
    assert {s.name for s in finished} >= {"kvpool.save", "kvpool.save.group"}


def test_lookup_span_joins_the_request_trace(spans, pool_settings, tmp_path_factory) -> None:
    from testing.kv_cache import GroupDesc
    from testing.scheduler import admit, make_request, make_scheduler, pool_transfer

    model = build_gemma3(tmp_path_factory.mktemp("gemma3-span"))
    scheduler = make_scheduler(
        model,
        [GroupDesc("full", 32), GroupDesc("sliding_window", 32, window=64)],
        pool_transfer(
            {
                "master_server_address": pool_settings.master_server_address,
                "cache_prefix": pool_settings.cache_prefix,
            }
        ),
    )
    try:
        request = make_request(scheduler, list(range(5, 5 + 3 * 32)))
        request.trace_headers = TRACEPARENT
        scheduler.add_request(request)
        admit(scheduler)
    finally:
        scheduler.shutdown()
    (lookup,) = [s for s in spans.get_finished_spans() if s.name == "kvpool.lookup"]
    assert format(lookup.context.trace_id, "032x") == TRACE_ID
    assert lookup.attributes["kvpool.request_id"] == request.request_id
    assert list(lookup.attributes["kvpool.groups"]) == ["full", "sliding_window"]
    assert list(lookup.attributes["kvpool.looked_up_blocks"]) == [2, 2]
    assert lookup.attributes["kvpool.hit_tokens"] == 0


def test_the_schedulers_first_stats_carry_its_groups_at_zero(pool_settings, tmp_path_factory) -> None:
    """A scheduler-side connector whose settings declare no layout: its first stats (the first
    step's, before any request) hold the zeros of the groups vLLM built, once."""
    from testing.kv_cache import GroupDesc
    from testing.scheduler import local_pool_transfer, make_scheduler

    model = build_gemma3(tmp_path_factory.mktemp("gemma3-zeros"))
    groups = [GroupDesc("full", 32), GroupDesc("sliding_window", 32, window=64)]
    scheduler = make_scheduler(model, groups, local_pool_transfer(pool_settings))
    try:
        first = scheduler.connector.get_kv_connector_stats()
        later = scheduler.connector.get_kv_connector_stats()
    finally:
        scheduler.shutdown()
    counters = first.data["counters"]
    assert counters == dict.fromkeys(zero_series(("full", "sliding_window")), 0.0)
    window = {"group": 1, "group_kind": "sliding_window"}
    assert series_key(m.FAILURES, **window, operation="save", reason="timeout") in counters
    assert later is None or not later.data.get("counters")


def test_the_scheduler_observes_a_requests_bytes_over_every_rank(pool_settings, tmp_path_factory) -> None:
    """vllm:kvpool_transfer_size_bytes observes a request's bytes over every rank: through
    vLLM's own ``Scheduler.update_from_output`` of a tensor-parallel-2 engine, the two workers'
    stats of one load (aggregated as vLLM's KVOutputAggregator does) become one observation,
    equal to what vllm:kvpool_transfer_bytes_total grows by (both ranks' bytes)."""
    import copy

    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput

    from testing.kv_cache import GroupDesc, block_sizes, make_kv_cache_config
    from testing.scheduler import engine_config, local_pool_transfer, scheduler_over

    kinds = ("full", "sliding_window")
    groups = [GroupDesc("full", 32), GroupDesc("sliding_window", 32, window=64)]
    model = build_gemma3(tmp_path_factory.mktemp("gemma3-tp2"))
    config = engine_config(model, local_pool_transfer(pool_settings))
    config.parallel_config.tensor_parallel_size = 2  # the scheduler's side only: no worker runs
    scheduler = scheduler_over(config, make_kv_cache_config(groups, num_blocks=2048), *block_sizes(groups))

    def worker_stats(rank: int, loaded: int) -> PoolConnectorStats:
        stats = StatsCollector(group_kinds=kinds, rank=rank)
        stats.record_transfer(
            TransferRecord(
                operation="load",
                group_kinds=kinds,
                blocks=(loaded, 2),
                masked=(0, 7),
                bytes=(loaded * 1024, 2 * 1024),
                failures={"missing": 8 - loaded} if loaded < 8 else {},
                seconds=0.02,
                group_failures=({"missing": 8 - loaded} if loaded < 8 else {}, {}),
                group_seconds=(0.015, 0.005),
                group_attempted=(True, True),
            )
        )
        return PoolConnectorStats(data=records_to_data(*stats.drain()))

    try:
        output = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
        workers = worker_stats(0, 8).aggregate(worker_stats(1, 7))
        output.kv_connector_output = KVConnectorOutput(kv_connector_stats=workers)
        (outputs,) = scheduler.update_from_output(scheduler.schedule(), output).values()
    finally:
        scheduler.shutdown()
    stats = outputs.scheduler_stats.kv_connector_stats
    moved = sum(v for k, v in stats["counters"].items() if parse_key(k)[0] == m.TRANSFER_BYTES.name)
    assert moved == (8 + 2 + 7 + 2) * 1024
    assert stats["histograms"][series_key(m.TRANSFER_SIZE_BYTES, operation="load")] == [moved]


# --- a real engine: counters equal ground truth, and Prometheus agrees ------------------


def _truth_bytes_per_block(llm: Any) -> list[int]:
    config = engine_core(llm).scheduler.kv_cache_config
    return [g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in config.kv_cache_groups]


def _series(llm: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], Any]:
    out = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:kvpool_"):
            labels = tuple(sorted((k, v) for k, v in metric.labels.items() if k not in m.VLLM_LABELS))
            out[(metric.name, labels)] = metric
    return out


def test_metrics_equal_ground_truth_and_prometheus_agrees(gemma_dir, pool_settings, spans) -> None:
    config = transfer_config(pool_settings)
    llm = create_llm(EngineOptions(model=str(gemma_dir), kv_transfer_config=config))
    try:
        generate(llm, [P1], MAX_TOKENS)
    finally:
        shutdown_llm(llm)

    llm = create_llm(EngineOptions(model=str(gemma_dir), kv_transfer_config=config, disable_log_stats=False))
    try:
        (result,) = generate(llm, [P2], MAX_TOKENS)
        per_block = _truth_bytes_per_block(llm)
        kinds = [
            "full" if type(g.kv_cache_spec).__name__ == "FullAttentionSpec" else "sliding_window"
            for g in engine_core(llm).scheduler.kv_cache_config.kv_cache_groups
        ]
        transfers = list(worker_connector().recording.transfers)
        series = _series(llm)
        _check_counters(series, result, kinds, per_block)
        _check_prometheus(kinds, transfers)
    finally:
        shutdown_llm(llm)


def _check_counters(series: dict, result: Any, kinds: list[str], per_block: list[int]) -> None:
    # Ground truth, counted from the prompts: P2 shares 9 whole blocks with P1; a
    # 64-token window at token 288 needs 2 blocks; P2's prompt completes block 9,
    # which B saves (block 10, completed while decoding, is not: save_decode_cache off).
    assert result.num_cached_tokens == PREFIX_HIT
    loaded = [9 if k == "full" else 2 for k in kinds]

    def value(name: str, **labels: object) -> float:
        key = (name, tuple(sorted((k, str(v)) for k, v in labels.items())))
        return series[key].value

    assert value("vllm:kvpool_lookups") == 1
    assert value("vllm:kvpool_lookup_query_tokens") == len(P2)
    assert value("vllm:kvpool_lookup_hit_tokens") == PREFIX_HIT
    for g, kind in enumerate(kinds):
        group = {"group": g, "group_kind": kind}
        assert value("vllm:kvpool_group_hit_tokens", **group) == PREFIX_HIT
        assert value("vllm:kvpool_present_blocks", **group) == 9
        assert value("vllm:kvpool_hit_blocks", **group) == loaded[g]
        assert value("vllm:kvpool_transfer_blocks", operation="load", **group) == loaded[g]
        assert value("vllm:kvpool_transfer_bytes", operation="load", **group) == loaded[g] * per_block[g]
        assert value("vllm:kvpool_masked_blocks", operation="load", **group) == 9 - loaded[g]
        assert value("vllm:kvpool_transfer_blocks", operation="save", **group) == 1
        assert value("vllm:kvpool_transfer_bytes", operation="save", **group) == per_block[g]
    failures = {k: s.value for k, s in series.items() if k[0] == "vllm:kvpool_failures"}
    assert failures and set(failures.values()) == {0.0}, "every reason's series, none counted"
    # Each load and save once in the size histogram, with every byte it moved.
    for op in ("load", "save"):
        size = series[("vllm:kvpool_transfer_size_bytes", (("operation", op),))]
        moved = sum(
            value("vllm:kvpool_transfer_bytes", operation=op, group=g, group_kind=kind)
            for g, kind in enumerate(kinds)
        )
        assert size.count == 1 and size.sum == moved, op


def _check_prometheus(kinds: list[str], transfers: list[TransferRecord]) -> None:
    """A real Prometheus scrapes the registry vLLM's /metrics serves."""
    server, thread = prometheus_client.start_http_server(free_port(), addr=LOOPBACK)
    port = server.server_address[1]
    try:
        with PrometheusServer({"vllm": [f"{LOOPBACK}:{port}"]}) as prom:
            prom.wait_for_scrapes("vllm")
            rates = prom.query(
                "sum by (group) (vllm:kvpool_group_hit_tokens_total)"
                " / scalar(sum(vllm:kvpool_lookup_query_tokens_total))"
            )
            assert {r["metric"]["group"]: float(r["value"][1]) for r in rates} == {
                str(g): PREFIX_HIT / len(P2) for g in range(len(kinds))
            }
            hybrid = prom.query(
                "sum(vllm:kvpool_lookup_hit_tokens_total) / sum(vllm:kvpool_lookup_query_tokens_total)"
            )
            assert float(hybrid[0]["value"][1]) == PREFIX_HIT / len(P2)
            p99 = prom.query(
                "histogram_quantile(0.99, sum by (le, group_kind) "
                '(vllm:kvpool_operation_seconds_bucket{operation="load"}))'
            )
            loads = [t for t in transfers if t.operation == "load"]
            for row in p99:
                kind = row["metric"]["group_kind"]
                truth = max(s for t in loads for s, k in zip(t.group_seconds, t.group_kinds) if k == kind)
                bounds = (0.0, *m.LATENCY_BUCKETS, float("inf"))
                i = bisect.bisect_left(bounds, truth)
                assert bounds[i - 1] <= float(row["value"][1]) <= bounds[i]
            assert {r["metric"]["group_kind"] for r in p99} == set(kinds)
    finally:
        server.shutdown()
        thread.join(5)


# --- over the wire -----------------------------------------------------------------------


def test_spans_reach_an_otlp_receiver_in_the_callers_trace(gemma_dir, pool_settings) -> None:
    config = transfer_config(pool_settings)
    run_engine_subprocess(EngineOptions(model=str(gemma_dir), kv_transfer_config=config), [[P1]], MAX_TOKENS)
    with OTLPReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint, "OTEL_SERVICE_NAME": "engine-b"}
        run_engine_subprocess(
            EngineOptions(model=str(gemma_dir), kv_transfer_config=config),
            [[P2]],
            MAX_TOKENS,
            trace_headers=TRACEPARENT,
            env=env,
        )
        received = receiver.received()
    by_name: dict[str, list[Any]] = {}
    for s in received:
        by_name.setdefault(s.name, []).append(s)
    assert {"kvpool.lookup", "kvpool.load", "kvpool.load.group", "kvpool.save"} <= set(by_name)
    for s in received:
        assert s.trace_id.hex() == TRACE_ID
    (lookup,) = by_name["kvpool.lookup"]
    (load,) = by_name["kvpool.load"]
    assert lookup.parent_span_id.hex() == PARENT_SPAN and load.parent_span_id.hex() == PARENT_SPAN
    assert {g.parent_span_id for g in by_name["kvpool.load.group"]} == {load.span_id}
    assert len(by_name["kvpool.load.group"]) == 3


# --- privacy -----------------------------------------------------------------------------


def _renderings(tokens: list[int], width: int = 4) -> set[str]:
    out = set()
    for i in range(len(tokens) - width + 1):
        window = tokens[i : i + width]
        for sep in (", ", ",", " "):
            out.add(sep.join(str(t) for t in window))
    return out


def _digest_parts(prompt: list[int]) -> set[str]:
    """Every 16-hex-digit piece of the key digests of ``prompt``'s blocks (a key, whole or cut,
    names its block's token prefix: with a dictionary of prompts, which one was sent)."""
    return {d[i : i + 16] for d in digests_of(prompt, range(len(prompt) // 32)) for i in (0, 16, 32, 48)}


def _binding_error(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls of ``method`` raise the Mooncake binding's own ``TypeError`` (its message repeats
    every argument, the keys included), as a call with an argument it does not take does."""
    store_class = mooncake_store_class()
    original = getattr(store_class, method)

    def wrong_call(store: Any, keys: Any, *args: Any) -> Any:
        return original(store, keys, *(None for _ in args), None)

    monkeypatch.setattr(store_class, method, wrong_call)


def _wait_reachable(llm: Any) -> None:
    """Until no client of the engine fails fast (it does for a while after failed batches)."""
    clients = [scheduler_connector(llm)._client, worker_connector(llm)._client]
    for _ in range(200):
        if not any(client.unreachable for client in clients):
            return
        time.sleep(0.05)
    raise AssertionError("a client still fails fast")


def _with_fault(llm: Any, prompt: list[int], install: Any) -> None:
    """``prompt`` served from an emptied local cache under the fault ``install`` sets up."""
    assert llm.reset_prefix_cache()
    with pytest.MonkeyPatch.context() as monkeypatch:
        install(monkeypatch)
        generate(llm, [prompt], 4, trace_headers=TRACEPARENT)
        wait_for_saves_here(None)  # its saves met the fault too


def test_a_logged_exception_keeps_its_message_less_keys_and_token_ids() -> None:
    """A logged exception's message stays, for the operator to read, less every digest and
    token-id run: a Mooncake binding's error repeats its call's keys."""
    key, token_ids = "prefix/0a1b2c3d/h3/pp0-tp0/g0/" + "ab" * 32, list(range(11, 15))
    try:
        try:
            raise TypeError(f"incompatible function arguments. Invoked with: [{key!r}], {token_ids}")
        except TypeError as exc:
            raise RuntimeError("batch failed at 127.0.0.1:12345") from exc
    except RuntimeError as exc:
        text = logs.describe_exception(exc)
    assert "incompatible function arguments" in text and "batch failed at 127.0.0.1:12345" in text
    assert "ab" * 8 not in text and "11, 12, 13, 14" not in text
    assert "prefix/0a1b2c3d/h3/pp0-tp0/g0/<redacted>" in text


def test_logging_an_exception_whose_message_raises_never_raises() -> None:
    """An exception whose ``__str__`` raises is logged by its type and traceback: the redacting
    filter never raises out of the logging call (a transfer's ``except`` block logs there)."""

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no message")

    logger = logs.get_logger("kvpool.test_unprintable")
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(logging.Formatter().format(record))  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        try:
            raise Unprintable()
        except Unprintable:
            logger.exception("KVPoolConnector save failed")
    finally:
        logger.removeHandler(handler)
    (line,) = lines
    assert "KVPoolConnector save failed" in line and "Unprintable: <exception str() failed>" in line


def test_an_exception_through_a_span_leaves_its_message_out(spans) -> None:
    """An exception escaping a span names its type only: its message may repeat pool keys."""
    spans.clear()
    key = "prefix/fp/h3/pp0-tp0/g0/" + "ab" * 32
    with pytest.raises(TypeError), tracing.span("kvpool.load", TRACEPARENT, request_id="r"):
        raise TypeError(f"incompatible function arguments. Invoked with: [{key!r}]")
    (finished,) = spans.get_finished_spans()
    assert finished.status.status_code is trace.StatusCode.ERROR
    assert finished.status.description == "TypeError"
    assert not finished.events


def test_no_token_ids_or_keys_in_spans_labels_or_logs(gemma_dir, pool_settings, spans) -> None:
    """Nothing the connector logs (DEBUG included, exceptions with their tracebacks), traces or
    labels carries a prompt's token ids or its blocks' keys: on the happy path, and through
    failed reads, corrupt objects and Mooncake errors on saves, lookups and reads."""
    rng = random.Random(99)
    shared = [rng.randrange(100, 500) for _ in range(200)]
    prompts = [
        shared + [rng.randrange(100, 500) for _ in range(30)],
        shared + [rng.randrange(100, 500) for _ in range(40)],
        [rng.randrange(100, 500) for _ in range(100)],  # saved under a save fault
        [rng.randrange(100, 500) for _ in range(100)],  # looked up under a lookup fault
    ]
    forbidden = set().union(*(_renderings(p) for p in prompts), *(_digest_parts(p) for p in prompts))

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    root = logging.getLogger("vllm")
    previous = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    spans.clear()
    config = transfer_config(pool_settings, lookup_timeout_s=30.0, save_timeout_s=30.0)
    try:
        llm = create_llm(
            EngineOptions(model=str(gemma_dir), kv_transfer_config=config, disable_log_stats=False)
        )
        try:
            # vLLM configures its loggers as the engine starts: listen (again) from here on.
            if handler not in root.handlers:
                root.addHandler(handler)
            root.setLevel(logging.DEBUG)
            connector = scheduler_connector(llm)
            generate(llm, prompts[:1], 4, trace_headers=TRACEPARENT)
            generate(llm, prompts[1:2], 4, trace_headers=TRACEPARENT)
            # Reads that fail; corrupt objects (found by their checks, removed).
            _with_fault(llm, prompts[1], FailingReads(digests_of(prompts[1], range(2, 6))).install)
            groups = len(connector.layout.groups)
            with bare_client(pool_settings.master_server_address) as client:
                store = raw_store(client)
                for key in pool_keys(connector.keyspace, prompts[0], groups, range(6, 7)):  # not shared
                    assert mooncake_store_class().upsert(store, key, b"x") == 0
            _with_fault(llm, prompts[0], lambda monkeypatch: None)
            # Reads, saves and lookups Mooncake's binding refuses (after batches of them all
            # failed, a client fails fast for a while: each next fault waits that out).
            for prompt, method in (
                (prompts[1], READ_METHOD),
                (prompts[2], "batch_put_from_multi_buffer_ranges"),
                (prompts[3], "batch_is_exist"),
            ):
                _wait_reachable(llm)
                _with_fault(llm, prompt, functools.partial(_binding_error, method))
                _wait_reachable(llm)  # the fault's saves (made after its step) fail fast no more
            exposition = prometheus_client.generate_latest().decode()
        finally:
            shutdown_llm(llm)
    finally:
        root.removeHandler(handler)
        root.setLevel(previous)

    ours = [r for r in records if r.name.startswith("vllm.kvpool")]
    assert ours, "the connector logged nothing to check"
    formatter = logging.Formatter("%(message)s")
    logged = [formatter.format(r) for r in ours]  # with each exception's message and traceback
    for expected in ("failed their check", "put-session call failed", "exist failed", "batch call failed"):
        assert any(expected in text for text in logged), f"no log line says {expected!r}: a path not taken"
    texts = list(logged)
    for s in spans.get_finished_spans():
        if s.name.startswith("kvpool."):
            texts.append(f"{s.name} {dict(s.attributes or {})} {s.status.description}")
            texts += [f"{e.name} {dict(e.attributes or {})}" for e in s.events]
    texts += [line for line in exposition.splitlines() if "kvpool" in line]
    assert len(texts) > 10
    for text in texts:
        leaked = [w for w in forbidden if w in text]
        assert not leaked, f"token ids or keys leaked into: {text[:300]}"
