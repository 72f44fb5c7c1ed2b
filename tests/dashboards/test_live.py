"""A real Prometheus scrapes a real run, and every dashboard query returns data.

The run: the session's Mooncake master (and store), two real in-process vLLM CPU engines with
the connector (a single-group model, then a hybrid one) doing lookups, loads, saves and failed
loads in rounds a few scrapes apart, and the real operator on kmock reconciling a pool through
an injected API failure. Prometheus (Debian's, on loopback) scrapes the master, vLLM's metrics
registry and the operator, with the alert rules loaded. Then every panel query, with Grafana's
variables filled in, must return at least one finite value; every variable query must answer;
every alert rule must evaluate cleanly.
"""

from __future__ import annotations

import asyncio
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
from tests.dashboards.queries import PanelQuery, finite, panel_queries, positive, substitute, variable_queries
from tests.operator.harness import Operator, converge, pool_manifest, vllm_deployment
from tests.support.kube_api import NAMESPACE, Cluster, Fault
from tests.support.services import PrometheusServer

pytestmark = [pytest.mark.engine, pytest.mark.mooncake]

VLLM_JOB = "vllm"
PAUSE = 2.5  # seconds between rounds: at least two scrapes apart, so every counter moves in a rate
LATE, EARLY = range(4, 9), range(0, 4)  # prefix blocks two failing loads lose (each within the hit)
EXPECTED_ZERO = {("Pool hit rate beside vLLM's prefix caches", "C")}  # the local cache, reset every round


@dataclass
class Run:
    prom: PrometheusServer
    operator_port: int
    started: float
    models: list[str] = field(default_factory=list)
    engines: set[str] = field(default_factory=set)


def _rounds(
    model: Path, settings: Any, client: Any, rounds: list[tuple[list[int], range | None]]
) -> set[str]:
    """Run ``rounds`` on one engine; return its engine labels.

    A round is a prompt and the prefix blocks to delete from the pool between its lookup and
    its load (the load of those blocks then fails), or None.
    """
    from kvpool.connector import scheduler_side
    from kvpool.connector.local.engine import (
        EngineOptions,
        create_llm,
        generate,
        scheduler_connector,
        shutdown_llm,
    )
    from tests.support.engine import transfer_config
    from tests.support.prompts import MAX_TOKENS, PREFIX, pool_keys

    llm = create_llm(
        EngineOptions(model=str(model), kv_transfer_config=transfer_config(settings), disable_log_stats=False)
    )
    try:
        connector = scheduler_connector(llm)
        original = scheduler_side.SchedulerSide.update_state_after_alloc

        for prompt, blocks in rounds:
            doomed = (
                []
                if blocks is None
                else pool_keys(connector.keyspace, PREFIX, len(connector.layout.groups), blocks)
            )

            def delete_then_alloc(self: Any, request: Any, block_ids: Any, num_external: int) -> Any:
                client.remove(doomed)  # noqa: B023 (used in this round only)
                return original(self, request, block_ids, num_external)

            llm.reset_prefix_cache()  # every round goes to the pool, not the local cache
            with pytest.MonkeyPatch.context() as patch:
                if doomed:
                    patch.setattr(scheduler_side.SchedulerSide, "update_state_after_alloc", delete_then_alloc)
                generate(llm, [prompt], MAX_TOKENS)
            time.sleep(PAUSE)
        return {m.labels["engine"] for m in llm.get_metrics() if "engine" in m.labels}
    finally:
        shutdown_llm(llm)


@pytest.fixture(scope="module")
def run(local_pool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    from kvpool.connector.contract.settings import ConnectorSettings
    from kvpool.connector.local.tiny_model import build_gemma3
    from kvpool.connector.pool_client import open_client
    from tests.support.prompts import P1, P2

    single = build_gemma3(
        tmp_path_factory.mktemp("gemma3-full"), num_hidden_layers=3, layer_types=["full_attention"] * 3
    )
    hybrid = build_gemma3(tmp_path_factory.mktemp("gemma3-hybrid"))
    settings = ConnectorSettings.parse(
        {"master_server_address": local_pool.address, "cache_prefix": f"dash{uuid.uuid4().hex[:8]}"}
    )
    server, thread = prometheus_client.start_http_server(free_port(), addr=LOOPBACK)
    operator_port = free_port()
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
        # Single group: a failed load hands its blocks back to vLLM (load_error_blocks).
        result.engines |= _rounds(single, settings, client, [(P1, None), (P2, LATE), (P1, EARLY)])
        # Hybrid: saves, hits, masked loads, a failed load that recomputes, hits again.
        result.engines |= _rounds(
            hybrid, settings, client, [(P1, None), (P2, None), (P1, LATE), (P2, None), (P1, EARLY)]
        )
        yield result
    finally:
        client.close()
        prom.stop()
        server.shutdown()
        thread.join(5)


@pytest.fixture
def operator_config(run: Run) -> dict[str, Any]:
    """The operator serves its metrics where Prometheus already looks."""
    return {"metrics_port": run.operator_port}


async def _operate(cluster: Cluster) -> None:
    """A pool reconciled to Ready through one injected API failure (a reconcile error)."""
    fault = cluster.api.fail(Fault("POST", "configmaps", 500))
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest())
    await converge(cluster, generation=1)
    assert fault.times == 0


def _answers(run: Run, values: dict[str, list[str]] | None = None) -> dict[PanelQuery, list[dict]]:
    """Every panel query's answer now, with the variables in ``values`` (the rest "All")."""
    window = f"{int(time.time() - run.started) + 60}s"  # every rate spans the whole run
    return {
        query: run.prom.query(substitute(query.expr, window, values))
        for uid, model in generate.dashboards().items()
        for query in panel_queries(uid, model)
    }


def _report(answers: dict[PanelQuery, list[dict]], failed: list[PanelQuery]) -> str:
    return "\n".join(f"{q}: {q.expr} -> {answers[q]}" for q in failed)


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
    empty = [q for q, rows in answers.items() if not finite(rows)]
    assert not empty, "panel queries without data:\n" + _report(answers, empty)

    # Specific models and engines, as Grafana writes a multi-value selection: the connector's
    # panels show what the run did (only vLLM's local prefix cache, reset every round, stays 0).
    chosen = {VAR_MODEL: run.models, VAR_ENGINE: sorted(run.engines)}
    answers = await asyncio.to_thread(_answers, run, chosen)
    connector = {q: rows for q, rows in answers.items() if q.dashboard == connector_board.UID}
    idle = [
        q for q, rows in connector.items() if not positive(rows) and (q.panel, q.ref) not in EXPECTED_ZERO
    ]
    assert not idle, "connector panels that do not show the run:\n" + _report(answers, idle)

    # The operator's per-pool gauges carry the pool's own namespace and name.
    answers = await asyncio.to_thread(_answers, run, {VAR_NAMESPACE: [NAMESPACE], VAR_POOL: ["pool"]})
    empty = [q for q, rows in answers.items() if q.dashboard == operator_board.UID and not finite(rows)]
    assert not empty, "operator panels without data for the chosen pool:\n" + _report(answers, empty)

    variables = await asyncio.to_thread(_check_variables, run)
    assert sorted(variables[(connector_board.UID, VAR_MODEL)]) == sorted(run.models)
    assert sorted(variables[(connector_board.UID, VAR_ENGINE)]) == sorted(run.engines)
    assert variables[(operator_board.UID, VAR_NAMESPACE)] == [NAMESPACE]
    assert variables[(operator_board.UID, VAR_POOL)] == ["pool"]

    broken = await asyncio.to_thread(_check_rules, run)
    assert not broken, broken
