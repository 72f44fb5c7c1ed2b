"""The dashboards' variables list every pool, and the panels keep to the pools chosen.

A real Prometheus scrapes a real Mooncake master (the session's, with the namespace and pool
labels the chart's monitors give its pod) and the operator's own collectors holding two pools'
status: one whose master it runs, and an external one, whose master (someone else's) Prometheus
does not scrape. Queries are sent as Grafana sends them (variables filled in).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import prometheus_client
import pytest

from dashboards import generate, operator_board, pool_board
from dashboards.conventions import MASTER_JOB, OPERATOR_JOB, VAR_NAMESPACE, VAR_POOL
from kvpool.connector.local.pool import LOOPBACK, free_port
from kvpool.operator import metrics
from testing.services import PrometheusServer
from tests.dashboards.queries import panel_queries, substitute, variable_queries

pytestmark = pytest.mark.mooncake

MANAGED = ("team-a", "cache")  # (namespace, pool): its master runs and is scraped
EXTERNAL = ("team-b", "shared")  # spec.external: its master is not scraped


def _status(valid: bool) -> dict[str, object]:
    config_valid = "True" if valid else "False"
    return {
        "phase": "Ready" if valid else "Error",
        "conditions": [
            {"type": "ConfigValid", "status": config_valid},
            {"type": "MasterReady", "status": "True"},
        ],
    }


@pytest.fixture(scope="module")
def prom(local_pool) -> Iterator[PrometheusServer]:
    operator = metrics.OperatorMetrics()
    operator.observe_pool(*MANAGED, _status(valid=True), metrics.MANAGED)
    operator.observe_pool(*EXTERNAL, _status(valid=False), metrics.EXTERNAL)
    port = free_port()
    server, thread = prometheus_client.start_http_server(port, LOOPBACK, operator.registry)
    namespace, pool = MANAGED
    targets = {
        MASTER_JOB: [f"{LOOPBACK}:{local_pool.master.metrics_port}"],
        OPERATOR_JOB: [f"{LOOPBACK}:{port}"],
    }
    try:
        with PrometheusServer(targets, {MASTER_JOB: {"namespace": namespace, "pool": pool}}) as prometheus:
            prometheus.wait_for_scrapes(MASTER_JOB)
            prometheus.wait_for_scrapes(OPERATOR_JOB)
            yield prometheus
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _variable(prom: PrometheusServer, uid: str, name: str, chosen: Mapping[str, list[str]]) -> list[str]:
    """The values Grafana lists for variable ``name`` with the ``chosen`` values upstream."""
    (var,) = [v for v in variable_queries(uid, generate.dashboards()[uid]) if v.name == name]
    return sorted(
        prom.api(f"label/{var.label}/values", **{"match[]": substitute(var.selector, values=chosen)})
    )


def _panel(
    prom: PrometheusServer, uid: str, title: str, chosen: Mapping[str, list[str]]
) -> dict[tuple[tuple[str, str], ...], float]:
    """The panel's (single) query, as Grafana sends it: each series' labels and value."""
    (query,) = [q for q in panel_queries(uid, generate.dashboards()[uid]) if q.panel == title]
    rows = prom.query(substitute(query.expr, values=chosen))
    return {tuple(sorted(row["metric"].items())): float(row["value"][1]) for row in rows}


def test_the_pool_dashboards_variables_list_external_pools(prom: PrometheusServer) -> None:
    """An external pool's status panels (phase, capacity, objects) show it: its namespace and
    name are listed though Prometheus scrapes no master of it."""
    uid = pool_board.UID
    assert _variable(prom, uid, VAR_NAMESPACE, {}) == sorted([MANAGED[0], EXTERNAL[0]])
    assert _variable(prom, uid, VAR_POOL, {}) == sorted([MANAGED[1], EXTERNAL[1]])
    assert _variable(prom, uid, VAR_POOL, {VAR_NAMESPACE: [EXTERNAL[0]]}) == [EXTERNAL[1]]
    phase = _panel(prom, uid, "Phase", {VAR_NAMESPACE: [EXTERNAL[0]], VAR_POOL: [EXTERNAL[1]]})
    assert list(phase.values()) == [1.0]


@pytest.mark.parametrize(
    ("chosen", "pools", "invalid"),
    [
        ({}, 2, 1),
        ({VAR_NAMESPACE: [MANAGED[0]]}, 1, 0),
        ({VAR_NAMESPACE: [EXTERNAL[0]], VAR_POOL: [EXTERNAL[1]]}, 1, 1),
        ({VAR_POOL: ["none"]}, 0, 0),
    ],
)
def test_the_operator_dashboards_pool_counts_keep_to_the_chosen_pools(
    prom: PrometheusServer, chosen: dict[str, list[str]], pools: int, invalid: int
) -> None:
    uid = operator_board.UID
    assert list(_panel(prom, uid, "Pools", chosen).values()) == [pools]
    assert list(_panel(prom, uid, "ConfigValid false", chosen).values()) == [invalid]
    by_condition = _panel(prom, uid, "Pools by condition", chosen)
    counted = {
        dict(labels)["condition"] + "=" + dict(labels)["status"]: v for labels, v in by_condition.items()
    }
    expected = {"ConfigValid=True": pools - invalid, "ConfigValid=False": invalid, "MasterReady=True": pools}
    assert counted == {k: v for k, v in expected.items() if v}
