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
    """``numerator / denominator`` where the denominator is above zero, matched ``on`` labels
    (many-to-one with ``group_left``): no sample where it is zero (an idle fleet's 0/0), never
    NaN or Inf. Each side binds at least as tightly as ``/`` (parenthesize a sum or an ``or``)."""
    matching = ""
    if on is not None:
        # ``group_left`` right before ``(`` would read the denominator as its label list.
        matching = f" on ({', '.join(on)})" + (" group_left ()" if group_left else "")
    return f"{numerator}\n/{matching}\n({denominator} > 0)"


def quantile(q: float, histogram: str, sel: str, labels: Sequence[str] = ()) -> str:
    """``histogram_quantile`` of a prometheus_client histogram's ``_bucket`` series, for the
    ``labels`` whose buckets moved in the window: no sample where none did (an idle fleet), where
    ``histogram_quantile`` would answer NaN."""
    buckets = histogram + "_bucket"
    observed = f"{sum_rate(buckets, sel, labels)} > 0"
    return (
        f"histogram_quantile({q}, {sum_rate(buckets, sel, ['le', *labels])}"
        f" and on ({', '.join(labels)}) ({observed}))"
    )
