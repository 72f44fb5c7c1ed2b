"""The committed dashboards and rules are the generator's output, and every query is sound.

Sound: it parses (promql-parser), every metric it names is exported by our code, by a real
Mooncake master (its /metrics read here) or by vLLM itself, and it honours the dashboard's
template variables.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard

from dashboards import alerts, connector_board, external, generate, operator_board, pool_board
from dashboards.conventions import NAMESPACE, POOL, VARIABLE_LABELS
from kvpool.connector.contract import metric_names as cm
from kvpool.operator import metric_names as om
from tests.dashboards.queries import panel_queries, selectors, substitute, variable_queries

REPO = Path(__file__).resolve().parents[2]
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _exported(specs) -> set[str]:
    names = set()
    for spec in specs:
        if spec.kind == "histogram":
            names |= {spec.name + suffix for suffix in HISTOGRAM_SUFFIXES}
        else:
            names.add(spec.exported)
    return names


OURS = _exported(cm.ALL) | _exported(om.ALL)


def vllm_counters() -> set[str]:
    """Counters vLLM defines (scraped with ``_total``), read from vLLM's own source."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    loggers = Path(spec.origin).parent / "v1" / "metrics" / "loggers.py"
    text = loggers.read_text()
    return {f"{name}_total" for name in re.findall(r'name="(vllm:[a-z_:]+)"', text)}


@pytest.fixture(scope="module")
def master_metrics(local_pool) -> set[str]:
    """Series names a real Mooncake master exports."""
    names = set()
    for line in local_pool.master.metrics().splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


@pytest.fixture(scope="module")
def models() -> dict[str, dict]:
    return generate.dashboards()


def test_the_chart_ships_every_dashboard_and_the_rules() -> None:
    outputs = generate.outputs()
    assert {str(p) for p in outputs} == {
        *(f"charts/mooncake-kvpool/files/dashboards/{uid}.json" for uid in generate.BOARDS),
        "charts/mooncake-kvpool/files/alerts.yaml",
    }
    rules = yaml.safe_load((REPO / "charts/mooncake-kvpool/files/alerts.yaml").read_text())
    assert [g["name"] for g in rules["groups"]] == list(alerts.GROUPS)


def test_dashboards_are_well_formed(models) -> None:
    expected_vars = {
        connector_board.UID: ["datasource", "namespace", "pool", "model", "engine"],
        pool_board.UID: ["datasource", "namespace", "pool"],
        operator_board.UID: ["datasource", "namespace", "pool"],
    }
    assert set(models) == set(expected_vars)
    for uid, model in models.items():
        assert model["uid"] == uid
        assert [v["name"] for v in model["templating"]["list"]] == expected_vars[uid]
        ids = [p["id"] for p in model["panels"]]
        assert len(ids) == len(set(ids)) and 0 not in ids
        for panel in model["panels"]:
            assert panel["gridPos"]["x"] >= 0 and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"], panel["title"]
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs))
        for var in model["templating"]["list"][1:]:
            assert var["includeAll"] and var["allValue"] == ".*" and var["multi"]
        # The SDK's own model reads the committed JSON back unchanged.
        committed = json.loads((REPO / generate.CHART_FILES / "dashboards" / f"{uid}.json").read_text())
        assert json.loads(JSONEncoder(sort_keys=True).encode(Dashboard.from_json(committed))) == committed


def test_every_query_parses_and_names_only_real_metrics(models, master_metrics) -> None:
    vllm = vllm_counters()
    known = OURS | master_metrics | vllm | {external.UP}
    mooncake = {
        name
        for name in vars(external).values()
        if isinstance(name, str) and name.startswith(("master_", "segment_", "ha_"))
    }
    assert mooncake and mooncake <= master_metrics, sorted(mooncake - master_metrics)
    exprs = [q.expr for uid, m in models.items() for q in panel_queries(uid, m)]
    exprs += [f"{v.selector}" for uid, m in models.items() for v in variable_queries(uid, m)]
    exprs += [a.expr for a in alerts.all_alerts()]
    unknown = set()
    for expr in exprs:
        for sel in selectors(substitute(expr)):
            assert sel.metric, f"a selector without a metric name in {expr}"
            if sel.metric not in known:
                unknown.add(sel.metric)
    assert not unknown, f"metrics nobody exports: {sorted(unknown)}"
    for name in external.VLLM_COUNTERS:
        assert external.total(name) in vllm
    for _, request, failure in external.MASTER_REQUESTS:
        assert {request, failure} <= master_metrics


def test_every_metric_of_ours_is_on_a_dashboard(models) -> None:
    shown = {
        sel.metric
        for uid, m in models.items()
        for q in panel_queries(uid, m)
        for sel in selectors(substitute(q.expr))
    }
    # The operator's fleet-wide count of pools by condition has no pool labels: the dashboards
    # count kvpool_operator_pool_condition instead, which the Namespace and Pool variables filter.
    for spec in (*cm.ALL, *(spec for spec in om.ALL if spec is not om.POOLS)):
        names = {spec.name + s for s in HISTOGRAM_SUFFIXES} if spec.kind == "histogram" else {spec.exported}
        assert names & shown, f"{spec.name} is on no dashboard"
    for name in external.VLLM_COUNTERS:
        assert external.total(name) in shown


def test_queries_honour_the_template_variables(models) -> None:
    """Every selector filters on each variable its series carry."""
    connector_labels = set(VARIABLE_LABELS.values())
    per_pool = {NAMESPACE, POOL}
    operator_wide = {om.RECONCILES, om.RECONCILE_ERRORS, om.RECONCILE_DURATION, om.API_WRITES}
    operator_wide_names = _exported(operator_wide)
    for uid, model in models.items():
        for query in panel_queries(uid, model):
            for sel in selectors(substitute(query.expr, values={v: ["x"] for v in VARIABLE_LABELS})):
                if uid == connector_board.UID:
                    required = connector_labels
                elif sel.metric in operator_wide_names:
                    required = set()
                else:
                    required = per_pool
                filtered = {
                    label for label, (op, value) in sel.matchers.items() if op == "Re" and value == "(x)"
                }
                assert required <= filtered, f"{query}: {sel.metric} ignores {required - filtered}"


def test_a_save_another_engine_is_making_is_no_failed_key(models) -> None:
    """in_flight (two engines saving the same shared prefix at once) is shown by kind, never
    counted among the failed keys: a healthy fleet shows no failures."""
    queries = list(panel_queries(connector_board.UID, models[connector_board.UID]))
    counted = [q for q in queries if q.panel in ("Failed keys per second", "Share of keys that failed")]
    assert len(counted) == 2
    for query in counted:
        numerator = query.expr.split("\n/", 1)[0]  # the share's denominator counts every key tried
        (failures,) = [s for s in selectors(substitute(numerator)) if s.metric == cm.FAILURES.exported]
        op, value = failures.matchers["reason"]
        assert op == "NotRe" and "in_flight" in value.split("|"), query
    (by_kind,) = [q for q in queries if q.panel == "Failed keys by kind"]
    assert all("reason" not in s.matchers for s in selectors(substitute(by_kind.expr)))


def test_failed_keys_leave_failed_lookups_out(models) -> None:
    """A failed lookup counts one per lookup, not per key: the panels that count failed keys
    read the loads' and saves' failures only (lookups are shown by kind)."""
    queries = list(panel_queries(connector_board.UID, models[connector_board.UID]))
    counted = [q for q in queries if q.panel in ("Failed keys per second", "Share of keys that failed")]
    assert len(counted) == 2
    for query in counted:
        failures = [s for s in selectors(substitute(query.expr)) if s.metric == cm.FAILURES.exported]
        assert failures, query
        for selector in failures:
            op, value = selector.matchers["operation"]
            assert op == "Re" and set(value.split("|")) == {cm.LOAD, cm.SAVE}, query
