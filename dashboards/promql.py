"""Small PromQL builders, so every query is written the same way."""

from __future__ import annotations

from collections.abc import Sequence

from dashboards.conventions import RATE_INTERVAL


def by(labels: Sequence[str]) -> str:
    return f" by ({', '.join(labels)})" if labels else ""


def rate(metric: str, sel: str = "", window: str = RATE_INTERVAL, offset: str = "") -> str:
    off = f" offset {offset}" if offset else ""
    return f"rate({metric}{sel}[{window}]{off})"


def sum_rate(
    metric: str, sel: str = "", labels: Sequence[str] = (), window: str = RATE_INTERVAL, offset: str = ""
) -> str:
    return f"sum{by(labels)} ({rate(metric, sel, window, offset)})"


def ratio(numerator: str, denominator: str, on: Sequence[str] | None = None, group_left: bool = False) -> str:
    """``numerator / denominator``, matched ``on`` labels (many-to-one with ``group_left``)."""
    matching = ""
    if on is not None:
        matching = f" on ({', '.join(on)})" + (" group_left" if group_left else "")
    return f"{numerator}\n/{matching}\n{denominator}"


def quantile(q: float, histogram: str, sel: str, labels: Sequence[str] = ()) -> str:
    """``histogram_quantile`` of a prometheus_client histogram's ``_bucket`` series."""
    return f"histogram_quantile({q}, {sum_rate(histogram + '_bucket', sel, ['le', *labels])})"
