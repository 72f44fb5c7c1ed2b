"""Every PromQL query the dashboards and alert rules hold, and the metric names in them."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import promql_parser

from dashboards.conventions import ALL_VALUE, RATE_INTERVAL, VARIABLE_LABELS

_VARIABLE_QUERY = re.compile(r"^label_values\((?P<selector>.+), (?P<label>\w+)\)$")


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref: str
    expr: str

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref}"


@dataclass(frozen=True)
class VariableQuery:
    dashboard: str
    name: str
    selector: str
    label: str


def panel_queries(uid: str, model: Mapping[str, Any]) -> Iterator[PanelQuery]:
    for panel in model["panels"]:
        for target in panel.get("targets", []):
            yield PanelQuery(uid, panel["title"], target["refId"], target["expr"])


def variable_queries(uid: str, model: Mapping[str, Any]) -> Iterator[VariableQuery]:
    for var in model["templating"]["list"]:
        if var["type"] != "query":
            continue
        match = _VARIABLE_QUERY.match(var["query"]["query"])
        assert match, var["query"]
        yield VariableQuery(uid, var["name"], match["selector"], match["label"])


def grafana_regex_escape(value: str) -> str:
    """How Grafana's Prometheus data source writes one value of a multi-value variable."""
    value = value.replace("\\", "\\\\\\\\")
    return re.sub(r"[$^*{}\[\]'+?.()|]", lambda m: "\\\\" + m.group(0), value)


def substitute(expr: str, window: str = "5m", values: Mapping[str, list[str]] | None = None) -> str:
    """``expr`` as Grafana sends it: the rate interval and every variable filled in.

    A variable missing from ``values`` is "All" (``.*``); one with values becomes Grafana's
    multi-value regex ``(a|b)``.
    """
    out = expr.replace(RATE_INTERVAL, window)
    for name in VARIABLE_LABELS:
        chosen = (values or {}).get(name)
        text = ALL_VALUE if not chosen else "(" + "|".join(grafana_regex_escape(v) for v in chosen) + ")"
        out = out.replace(f"${name}", text)
    assert "$" not in out, f"unsubstituted variable in {out}"
    return out


@dataclass(frozen=True)
class Selector:
    metric: str
    matchers: dict[str, tuple[str, str]]  # label -> (op, value)


def selectors(expr: str) -> list[Selector]:
    """Every vector selector in ``expr`` (parsed by promql-parser); one of several metric names
    (``{__name__=~"a|b"}``) once per name."""
    found: list[Selector] = []

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            matchers = {m.name: (str(m.op).rsplit(".", 1)[-1], m.value) for m in node.matchers.matchers}
            op, names = matchers.get("__name__", ("", ""))
            # ``{__name__=~"a|b"}`` selects each of the names it lists.
            for name in [node.name] if node.name else names.split("|") if op == "Re" else [names]:
                found.append(Selector(name, matchers))
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def finite(rows: list[dict[str, Any]]) -> bool:
    """At least one series with a finite value (an instant query's answer)."""
    return any(math.isfinite(float(row["value"][1])) for row in rows)


def positive(rows: list[dict[str, Any]]) -> bool:
    """At least one series with a value above zero."""
    return any(float(row["value"][1]) > 0 for row in rows)
