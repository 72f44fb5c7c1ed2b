"""An idle fleet for ``promtool test rules``: every series some queries read, none moving.

Two idle fleets: one that served before (counters present but flat over every window, gauges
at a steady value) and one that never served (counters all zero, gauges zero too: consumers
that looked nothing up, a pool with no memory mounted, a grant without quota). On either, a
ratio's denominator is zero: the query must answer no sample (or 0 where 0 is the truth),
never NaN or ±Inf.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from dashboards.conventions import ALL_VALUE
from tests.dashboards.queries import selectors

# Each series' value throughout, by fleet.
IDLE_FLEETS = {"flat": 1000.0, "zero": 0.0}
# What every series carries: one engine of one model in one pool (a master's series, the
# operator's and vLLM's alike; a label a metric lacks only adds a constant here).
BASE_LABELS = {
    "namespace": "team-a",
    "pool": "pool-a",
    "model_name": "small",
    "engine": "0",
    "instance": "10.0.0.1:8000",
}
BUCKET_BOUNDS = ("0.1", "+Inf")  # a histogram's ``_bucket`` series: one bound and the last


def _series(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def _matches(labels: dict[str, str], matchers: dict[str, tuple[str, str]]) -> bool:
    """Whether ``labels`` satisfy every matcher but the metric name's (a missing label is "")."""
    for name, (op, wanted) in matchers.items():
        if name == "__name__":
            continue
        value = labels.get(name, "")
        holds = {
            "Equal": value == wanted,
            "NotEqual": value != wanted,
            "Re": re.fullmatch(wanted, value) is not None,
            "NotRe": re.fullmatch(wanted, value) is None,
        }[op]
        if not holds:
            return False
    return True


def idle_history(exprs: Iterable[str], value: float, minutes: int) -> dict[str, str]:
    """promtool input series (selector -> values): for every vector selector in ``exprs`` (with
    their variables filled in), one series it selects, holding ``value`` for ``minutes``."""
    history: dict[str, str] = {}
    for expr in exprs:
        for selector in selectors(expr):
            labels = dict(BASE_LABELS)
            for name, (op, wanted) in selector.matchers.items():
                if name == "__name__":
                    continue
                if op == "Equal":
                    labels[name] = wanted
                elif op == "Re" and wanted != ALL_VALUE:
                    labels[name] = wanted.split("|")[0]
            assert _matches(labels, selector.matchers), f"no idle series for {selector} in {expr}"
            bounds = BUCKET_BOUNDS if selector.metric.endswith("_bucket") else ("",)
            for bound in bounds:
                with_bound = {**labels, "le": bound} if bound else labels
                history[_series(selector.metric, with_bound)] = f"{value:g}x{minutes}"
    return history


def non_finite(expr: str, name: str = "") -> str:
    """A query for ``expr``'s NaN and ±Inf samples only (a comparison drops NaN, the bounds
    drop ±Inf); ``name`` heads it as a comment, so promtool's report says whose it is."""
    comment = f"# {name}\n" if name else ""
    return f"{comment}(\n{expr}\n)\nunless\n(\n(\n{expr}\n) > -Inf < +Inf\n)"
