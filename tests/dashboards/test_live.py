"""A real Prometheus scrapes a real run, and every dashboard query returns data.

The run: the session's Mooncake master (and store), real in-process vLLM CPU engines with the
connector (a single-group model, then a hybrid one) doing lookups, loads, saves, failed loads
and loads of replaced (corrupt, then removed) objects in rounds a few scrapes apart, one engine
whose declared layout differs from the one vLLM builds (out of the pool), and the real operator
on kmock reconciling a pool through an injected API failure. Prometheus (Debian's, on loopback)
scrapes the master, vLLM's metrics registry and the operator, with the alert rules loaded. Then
every panel query, with Grafana's variables filled in, must return at least one finite value;
every variable query must answer; every alert rule must evaluate cleanly.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import prometheus_client
import pytest

from dashboards import alerts, connector_board, generate, operator_board
from dashboards.conventions import MASTER_JOB, OPERATOR_JOB, VAR_ENGINE, VAR_MODEL, VAR_NAMESPACE, VAR_POOL
from kvpool.connector.local.pool import LOOPBACK, free_port
from kvpool.connector.local.ports import held_port, release_port
from kvpool.operator import names
from testing.kube_api import NAMESPACE, Cluster, Fault
from testing.operator_objects import Operator, converge, pool_manifest, pool_spec, vllm_deployment
from testing.services import PrometheusServer
from tests.dashboards.queries import PanelQuery, finite, panel_queries, positive, substitute, variable_queries

pytestmark = [pytest.mark.engine, pytest.mark.mooncake]

VLLM_JOB = "vllm"
PAUSE = 2.5  # seconds between rounds: at least two scrapes apart, so every counter moves in a rate
# The deciding engine's reads: its ~0.4 MiB hit loads in ~0.2 s, so loading is estimated
# 101 times faster than recomputing only where a prefill of it would take over 20 s.
DECIDING_LINK = 2 << 20
LATE, EARLY = range(4, 9), range(0, 4)  # prefix blocks two failing loads lose (each within the hit)
REMOVE, REPLACE = "remove", "replace"  # what happens to a round's prefix blocks before its load
EXPECTED_ZERO = {("Pool hit rate beside vLLM's prefix caches", "C")}  # the local cache, reset every round
# The session's master runs without tenancy, so no grant has usage here: the grant gauges are
# checked on the operator's /metrics in tests/operator/test_grant_usage.py (a stand-in master)
# and against a real multi-tenant master in tests/operator/test_real_tenancy.py.
WITHOUT_TENANCY = {"Memory per grant", "Use of quota per grant", "Writes refused for quota per grant"}
# kmock runs no pods, so the operator has no consumer pod to ask for its hits: the consumer hit
# gauges are checked against real vLLM pods in tests/e2e/test_pool.py (per grant: against stand-in
# pods in tests/operator/test_consumer_hits.py).
WITHOUT_CONSUMER_PODS = {"Consumers' hit rate in the status", "Grants' hit rate in the status"}
# The drain gauge has series only while a scale-down waits for a drain, which this run does not
# do: its exposition is checked in tests/operator/test_store_drain.py.
WITHOUT_DRAIN = {"Store drain"}


@dataclass
class Run:
    prom: PrometheusServer
    operator_port: int
    started: float
    models: list[str] = field(default_factory=list)
    engines: set[str] = field(default_factory=set)
    # Models of engines an earlier test ran in this process: vLLM's series stay in the
    # process's registry, so the dashboard's model variable lists them too.
    earlier_models: set[str] = field(default_factory=set)
    # When each engine but the last was done: a new engine drops the series of the one
    # before, so a panel that reads a value now (a gauge, a counter's total) shows an
    # earlier engine's only at these moments, as Grafana's graph of that time does.
    engine_ends: list[float] = field(default_factory=list)


def models_in_registry() -> set[str]:
    """Every ``model_name`` label this process's Prometheus registry exports now."""
    return {
        sample.labels["model_name"]
        for metric in prometheus_client.REGISTRY.collect()
        for sample in metric.samples
        if "model_name" in sample.labels
    }


def fresh_prompt(seed: int) -> list[int]:
    """The shared prefix, then 50 tokens of its own: the pool holds at most its first 9 blocks."""
    from testing.prompts import PREFIX

    rng = random.Random(seed)
    return PREFIX + [rng.randrange(3, 500) for _ in range(50)]


def _rounds(
    model: Path, settings: Any, client: Any, rounds: list[tuple[list[int], range | None, str]]
) -> tuple[set[str], Any]:
    """Run ``rounds`` on one engine; return its engine labels and the layout vLLM built.

    A round is a prompt, the prefix blocks to remove from the pool (``REMOVE``: their load
    fails) or to replace with random bytes (``REPLACE``: the load finds them corrupt and
    removes them) between its lookup and its load, or None, and which of the two.
    """
    from kvpool.connector.scheduler import side as scheduler_side
    from testing.engine import (
        EngineOptions,
        create_llm,
        generate,
        scheduler_connector,
        shutdown_llm,
        transfer_config,
    )
    from testing.pool_store import raw_store
    from testing.prompts import MAX_TOKENS, PREFIX, pool_keys

    llm = create_llm(
        EngineOptions(model=str(model), kv_transfer_config=transfer_config(settings), disable_log_stats=False)
    )
    try:
        connector = scheduler_connector(llm)
        original = scheduler_side.SchedulerSide.update_state_after_alloc

        for prompt, blocks, how in rounds:
            doomed = (
                []
                if blocks is None or not connector.layout_verdict.in_pool
                else pool_keys(connector.keyspace, PREFIX, len(connector.layout.groups), blocks)
            )

            def delete_then_alloc(self: Any, request: Any, block_ids: Any, num_external: int) -> Any:
                if how == REMOVE:  # noqa: B023 (used in this round only)
                    client.remove(doomed)  # noqa: B023
                else:
                    for key in doomed:  # noqa: B023
                        assert raw_store(client).upsert(key, os.urandom(4096)) == 0
                return original(self, request, block_ids, num_external)

            llm.reset_prefix_cache()  # every round goes to the pool, not the local cache
            with pytest.MonkeyPatch.context() as patch:
                if doomed:
                    patch.setattr(scheduler_side.SchedulerSide, "update_state_after_alloc", delete_then_alloc)
                generate(llm, [prompt], MAX_TOKENS)
            time.sleep(PAUSE)
        engines = {m.labels["engine"] for m in llm.get_metrics() if "engine" in m.labels}
        return engines, connector.layout
    finally:
        shutdown_llm(llm)


@pytest.fixture(scope="module")
def run(local_pool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    from kvpool.connector.contract.layout import fingerprint
    from kvpool.connector.contract.settings import ConnectorSettings
    from kvpool.connector.pool_client import open_client
    from testing.models import build_gemma3
    from testing.prompts import P1, P2
    from testing.slow_link import RateCap

    single = build_gemma3(
        tmp_path_factory.mktemp("gemma3-full"), num_hidden_layers=3, layer_types=["full_attention"] * 3
    )
    hybrid = build_gemma3(tmp_path_factory.mktemp("gemma3-hybrid"))
    settings = ConnectorSettings.parse(
        {"master_server_address": local_pool.address, "cache_prefix": f"dash{uuid.uuid4().hex[:8]}"}
    )
    server, thread = prometheus_client.start_http_server(free_port(), addr=LOOPBACK)
    operator_port = held_port()  # the operator binds it tests later: held until the run ends
    targets = {
        MASTER_JOB: [f"{LOOPBACK}:{local_pool.master.metrics_port}"],
        VLLM_JOB: [f"{LOOPBACK}:{server.server_address[1]}"],
        OPERATOR_JOB: [f"{LOOPBACK}:{operator_port}"],  # up once the operator starts
    }
    prom = PrometheusServer(targets, rule_files=[generate.ROOT / generate.CHART_FILES / generate.ALERTS_FILE])
    client = open_client(settings, global_segment_size=0)
    try:
        prom.start()
        prom.wait_for_scrapes(MASTER_JOB)
        prom.wait_for_scrapes(VLLM_JOB)
        result = Run(prom, operator_port, time.time(), [str(single), str(hybrid)])
        result.earlier_models = models_in_registry()
        # Single group: a failed load hands its blocks back to vLLM (load_error_blocks); a
        # load of replaced objects finds them corrupt and removes them. Each kind of fault
        # happens twice, rounds apart, so each of its counters moves between scrapes; the
        # last round (no fault) carries the step stats of the one before to /metrics.
        # Fresh prompts (the shared prefix, then a block the pool does not hold) have the
        # forward compute a whole block on top of the failed load: a save kept out of the pool.
        # No lookup budget: every lookup answers a step later (the deferral panel shows it).
        q1, q2, q3 = (fresh_prompt(seed) for seed in range(3))
        deferring = settings.model_copy(update={"lookup_budget_ms": 0.0})
        engines, built = _rounds(
            single, deferring, client,
            [(P1, None, REMOVE), (q1, LATE, REMOVE), (P1, EARLY, REMOVE), (q2, EARLY, REPLACE),
             (q3, LATE, REPLACE), (P2, None, REMOVE)],
        )  # fmt: skip
        result.engines |= engines
        result.engine_ends.append(time.time())
        # Hybrid: saves, hits, masked loads, a failed load that recomputes, hits again; then,
        # its rates learned from three clean loads, a hit the load decision recomputes (a
        # margin of 100: loading must be estimated 101 times faster than recomputing). Its
        # reads are slowed to DECIDING_LINK (``RateCap``): a prefill slowed by a busy machine
        # must not make loading look that much faster (a CI run's hit loaded).
        deciding = settings.model_copy(
            update={"load_policy": "auto", "load_margin": 100, "load_decision_min_samples": 3}
        )
        with pytest.MonkeyPatch.context() as slowed:
            RateCap(DECIDING_LINK).install(slowed)
            engines, _ = _rounds(
                hybrid, deciding, client,
                [(P1, None, REMOVE), (P2, None, REMOVE), (P1, LATE, REMOVE), (P2, None, REMOVE),
                 (P1, EARLY, REMOVE), (P2, None, REMOVE), (P1, None, REMOVE)],
            )  # fmt: skip
        result.engines |= engines
        result.engine_ends.append(time.time())
        # An engine declared with another dtype than vLLM builds: out of the pool, counted.
        declared = built.model_copy(update={"dtype": "float32" if built.dtype != "float32" else "bfloat16"})
        wrong = settings.model_copy(
            update={"declared_layout": declared, "declared_layout_fingerprint": fingerprint(declared)}
        )
        engines, _ = _rounds(single, wrong, client, [(P1, None, REMOVE)])
        result.engines |= engines
        yield result
    finally:
        client.close()
        prom.stop()
        release_port(operator_port)
        server.shutdown()
        thread.join(5)


@pytest.fixture
def operator_config(run: Run, local_pool: Any) -> dict[str, Any]:
    """The operator serves its metrics where Prometheus already looks, and reads the pool's
    capacity from the real master (as a pool's NetworkPolicy lets its pods do)."""
    from kvpool.operator.policy import OperatorPolicy

    return {
        "metrics_port": run.operator_port,
        "master_health_url": f"http://{LOOPBACK}:{local_pool.master.metrics_port}/health",
        "observe_interval": 0.5,
        "policy": OperatorPolicy(operator_namespace="kvpool-system", operator_pod_labels=(("app", "op"),)),
    }


async def _operate(cluster: Cluster) -> None:
    """A pool reconciled to Ready through one injected API failure (a reconcile error)."""
    fault = cluster.api.fail(Fault("POST", "configmaps", 500))
    await cluster.create(vllm_deployment())
    # One store pod, at the address of the real store the master counts (its segment's host).
    await cluster.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "pool-store-0",
                "namespace": NAMESPACE,
                "labels": {names.LABEL_POOL: "pool", names.LABEL_COMPONENT: names.STORE},
            },
            "spec": {"containers": [{"name": "store", "image": "mooncake"}]},
            "status": {"podIP": LOOPBACK},
        }
    )
    await cluster.create(pool_manifest(spec=pool_spec(store={"segmentSize": "1GB", "replicas": 1})))
    await converge(cluster, generation=1)
    assert fault.times == 0


def _answers(run: Run, values: dict[str, list[str]] | None = None) -> dict[PanelQuery, list[dict]]:
    """Every panel query's answer, with the variables in ``values`` (the rest "All"): now,
    or, where now has no series, when the latest earlier engine that left one was done."""
    window = f"{int(time.time() - run.started) + 60}s"  # every rate spans the whole run
    answers = {}
    for uid, model in generate.dashboards().items():
        for query in panel_queries(uid, model):
            expr = substitute(query.expr, window, values)
            rows = run.prom.query(expr)
            for moment in reversed(run.engine_ends):
                if rows:
                    break
                rows = run.prom.query(expr, at=moment)
            answers[query] = rows
    return answers


def _report(answers: dict[PanelQuery, list[dict]], failed: list[PanelQuery]) -> str:
    return "\n".join(f"{q}: {q.expr} -> {answers[q]}" for q in failed)


def _samples(run: Run, queries: list[PanelQuery]) -> str:
    """Every sample Prometheus holds of the series ``queries`` read (to tell "never moved" apart)."""
    window = f"{int(time.time() - run.started) + 60}s"
    names = sorted({name for q in queries for name in re.findall(r"vllm:kvpool_\w+", q.expr)})
    rows = {name: run.prom.query(f"{name}[{window}]") for name in names}
    return "\nsamples:\n" + "\n".join(
        f"{r['metric']}: {[v for _, v in r['values']]}" for name in names for r in rows[name]
    )


def _check_variables(run: Run) -> dict[tuple[str, str], list[str]]:
    """Each variable query's values, as Grafana asks Prometheus for them (All upstream)."""
    out = {}
    for uid, model in generate.dashboards().items():
        for var in variable_queries(uid, model):
            match = substitute(var.selector)
            out[(uid, var.name)] = run.prom.api(f"label/{var.label}/values", **{"match[]": match})
    return out


def _check_rules(run: Run) -> list[str]:
    groups = run.prom.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == len(alerts.all_alerts())
    return [f"{r['name']}: {r.get('lastError')}" for r in rules if r["health"] != "ok"]


@pytest.mark.asyncio
async def test_every_panel_query_returns_data(run: Run, cluster: Cluster, operator: Operator) -> None:
    await _operate(cluster)
    prom = run.prom
    await asyncio.to_thread(prom.wait_for_scrapes, OPERATOR_JOB, 3)
    await asyncio.sleep(PAUSE)  # resync passes keep the operator's counters moving

    answers = await asyncio.to_thread(_answers, run)
    assert len(answers) > 60
    empty = [
        q
        for q, rows in answers.items()
        if not finite(rows) and q.panel not in WITHOUT_TENANCY | WITHOUT_CONSUMER_PODS | WITHOUT_DRAIN
    ]
    assert not empty, "panel queries without data:\n" + _report(answers, empty)

    # Specific models and engines, as Grafana writes a multi-value selection: the connector's
    # panels show what the run did (only vLLM's local prefix cache, reset every round, stays 0).
    chosen = {VAR_MODEL: run.models, VAR_ENGINE: sorted(run.engines)}
    answers = await asyncio.to_thread(_answers, run, chosen)
    connector = {q: rows for q, rows in answers.items() if q.dashboard == connector_board.UID}
    idle = [
        q for q, rows in connector.items() if not positive(rows) and (q.panel, q.ref) not in EXPECTED_ZERO
    ]
    report = _report(answers, idle) + _samples(run, idle)
    assert not idle, "connector panels that do not show the run:\n" + report

    # The operator's per-pool gauges carry the pool's own namespace and name.
    answers = await asyncio.to_thread(_answers, run, {VAR_NAMESPACE: [NAMESPACE], VAR_POOL: ["pool"]})
    empty = [q for q, rows in answers.items() if q.dashboard == operator_board.UID and not finite(rows)]
    assert not empty, "operator panels without data for the chosen pool:\n" + _report(answers, empty)

    variables = await asyncio.to_thread(_check_variables, run)
    assert sorted(variables[(connector_board.UID, VAR_MODEL)]) == sorted(set(run.models) | run.earlier_models)
    assert sorted(variables[(connector_board.UID, VAR_ENGINE)]) == sorted(run.engines)
    assert variables[(operator_board.UID, VAR_NAMESPACE)] == [NAMESPACE]
    assert variables[(operator_board.UID, VAR_POOL)] == ["pool"]

    broken = await asyncio.to_thread(_check_rules, run)
    assert not broken, broken
