"""Every panel query is shown in a unit that matches what it measures.

What a query measures is read from its PromQL: a histogram quantile of ``_seconds`` is a time,
of ``_bytes`` a size; a rate of ``_bytes`` (or a ``_bytes_per_second`` gauge) a throughput, a
``_bytes`` gauge a size; two like quantities divided (tokens over tokens, bytes over bytes, ...)
a share; anything else a count, or a rate or mean of counts. A query's unit is its panel's, or
the panel's override for its query.
"""

from __future__ import annotations

from typing import Any

import promql_parser
import pytest

from dashboards import generate
from tests.dashboards.queries import substitute

UNITS = {
    "time": {"s"},
    "size": {"bytes", "decbytes"},
    "throughput": {"binBps", "Bps"},
    "share": {"percentunit"},
    "count": {"short", "none", "ops", "reqps"},
}
# The quantity a metric counts, where its name's last word does not say it: vLLM's prefix-cache
# hits and queries are tokens, the connector's failures are keys.
SAME_AS = {"hits": "tokens", "queries": "tokens", "failures": "keys"}
RATES = ("rate", "irate")


def _unwrap(node: Any) -> Any:
    while isinstance(node, promql_parser.ParenExpr):
        node = node.expr
    return node


def _metrics(node: Any, inside: tuple[str, ...] = ()) -> set[str]:
    """The metric names ``node`` selects (only those under a call of ``inside``, if given)."""
    found: set[str] = set()

    def visit(n: Any) -> bool:
        if inside and isinstance(n, promql_parser.Call) and n.func.name in inside:
            for arg in n.args:
                found.update(_metrics(arg))
        elif not inside and isinstance(n, promql_parser.VectorSelector):
            found.add(n.name)
        return True

    promql_parser.walk(node, visit)
    return found


def _dimension(metric: str) -> str:
    word = metric.split(":")[-1].removesuffix("_total").rsplit("_", 1)[-1]
    return SAME_AS.get(word, word)


def _is_bool_comparison(node: Any) -> bool:
    """``a > bool b`` and the like: 1 where it holds, else 0."""
    node = _unwrap(node)
    return isinstance(node, promql_parser.BinaryExpr) and bool(node.modifier and node.modifier.return_bool)


def quantity(expr: str) -> str:
    """What a panel query measures: a key of ``UNITS``."""
    node = _unwrap(promql_parser.parse(substitute(expr)))
    if isinstance(node, promql_parser.BinaryExpr):
        if str(node.op) == "/":
            dimensions = {_dimension(name) for name in _metrics(node)}
            return "share" if len(dimensions) == 1 else "count"  # else a mean: counts over counts
        if str(node.op) in (">", "<", ">=", "<=", "==", "!="):  # a filter keeps the left's values
            return quantity(_unwrap(node.lhs).prettify())
    if isinstance(node, promql_parser.AggregateExpr) and (
        str(node.op) in ("count", "count_values") or _is_bool_comparison(node.expr)
    ):
        return "count"  # series counted, or 1s and 0s of a comparison added up
    names = _metrics(node)
    if isinstance(node, promql_parser.Call) and node.func.name == "histogram_quantile":
        (histogram,) = {name.removesuffix("_bucket") for name in names}
        assert histogram.endswith(("_seconds", "_bytes")), f"a quantile of what? {expr}"
        return "time" if histogram.endswith("_seconds") else "size"
    if any("_seconds" in name for name in names):
        assert all("_seconds" in name for name in names), f"seconds beside other things: {expr}"
        return "time"
    if any("_bytes" in name for name in names):
        assert all("_bytes" in name for name in names), f"bytes beside other things: {expr}"
        per_second = names & _metrics(node, RATES) or any(n.endswith("_per_second") for n in names)
        return "throughput" if per_second else "size"
    return "count"


def panel_units() -> list[tuple[str, str, str, str]]:
    """(panel, refId, query, unit shown) of every query of every dashboard."""
    rows = []
    for uid, model in generate.dashboards().items():
        for panel in model["panels"]:
            config = panel.get("fieldConfig", {})
            unit = config.get("defaults", {}).get("unit", "")
            overrides = {
                o["matcher"]["options"]: prop["value"]
                for o in config.get("overrides", [])
                if o["matcher"]["id"] == "byFrameRefID"
                for prop in o["properties"]
                if prop["id"] == "unit"
            }
            for target in panel.get("targets", []):
                ref = target["refId"]
                rows.append((f"{uid} / {panel['title']}", ref, target["expr"], overrides.get(ref, unit)))
    return rows


@pytest.mark.parametrize(("panel", "ref", "expr", "unit"), panel_units(), ids=lambda v: str(v)[:60])
def test_every_query_is_shown_in_its_quantitys_unit(panel: str, ref: str, expr: str, unit: str) -> None:
    measures = quantity(expr)
    assert unit in UNITS[measures], f"{panel} / {ref} measures a {measures}, shown in {unit!r}"


def test_the_reading_of_queries_knows_each_quantity() -> None:
    rate = "sum(rate(vllm:kvpool_{}[$__rate_interval]))"
    assert quantity("histogram_quantile(0.99, sum by (le) (rate(x_seconds_bucket[5m])))") == "time"
    assert quantity("histogram_quantile(0.5, sum by (le) (rate(x_size_bytes_bucket[5m])))") == "size"
    assert quantity(rate.format("transfer_bytes_total")) == "throughput"
    assert quantity("max(vllm:kvpool_load_rate_bytes_per_second)") == "throughput"
    assert quantity("max(master_allocated_bytes)") == "size"
    assert quantity("sum(master_allocated_bytes) / sum(master_total_capacity_bytes)") == "share"
    hit = f"{rate.format('lookup_hit_tokens_total')} / {rate.format('lookup_query_tokens_total')}"
    assert quantity(hit) == "share"
    assert quantity(
        "sum(rate(vllm:prefix_cache_hits_total[5m])) / sum(rate(vllm:prefix_cache_queries_total[5m]))"
    ) == ("share")
    mean = f"{rate.format('lookup_deferred_steps_total')} / {rate.format('lookups_total')}"
    assert quantity(mean) == "count"
    assert quantity("count by (pool) (master_total_capacity_bytes > 0)") == "count"
    assert quantity("sum by (pool) (master_total_capacity_bytes > bool 0)") == "count"
    assert quantity("sum by (pool) (master_total_capacity_bytes > 0)") == "size"
    assert quantity("max by (pool, phase) (kvpool_operator_pool_phase) > 0") == "count"
    assert quantity(rate.format("lookups_total")) == "count"
