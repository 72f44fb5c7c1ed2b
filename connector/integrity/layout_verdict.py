"""At start-up: the declared layout against the one vLLM built; out of the pool on any difference.

A consumer the operator configured carries its declared layout and fingerprint
(``declared_layout``, ``declared_layout_fingerprint``). When they differ from the
layout vLLM built, the connector logs one error naming every differing field,
counts each field once in ``vllm:kvpool_layout_mismatches_total`` (scheduler
side, one engine), and never connects to the pool: the engine serves as if it
had no connector, so a wrong declaration never mixes layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpool.connector.contract import metric_names as m
from kvpool.connector.contract.declared_layout import LayoutDifference, differences, mismatch_message
from kvpool.connector.contract.layout import KVLayout, fingerprint
from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.observability.logs import get_logger
from kvpool.connector.observability.vllm_metrics import series_key

logger = get_logger(__name__)


@dataclass
class LayoutVerdict:
    """Whether this connector may use the pool, and why not."""

    differences: list[LayoutDifference] = field(default_factory=list)
    reports_metric: bool = False
    _reported: bool = False

    @property
    def in_pool(self) -> bool:
        return not self.differences

    def take_counters(self) -> dict[str, float]:
        """The mismatch counters, once (then nothing): one per differing field."""
        if self._reported or not self.reports_metric or not self.differences:
            return {}
        self._reported = True
        return {series_key(m.LAYOUT_MISMATCHES, field=d.field): 1.0 for d in self.differences}


def verify_declared_layout(settings: ConnectorSettings, built: KVLayout, *, scheduler: bool) -> LayoutVerdict:
    """Compare the declared layout (if any) with ``built``; log the outcome once per role."""
    found = differences(
        built, settings.declared_layout, settings.declared_layout_fingerprint, per_stage=built.pp_size > 1
    )
    if found:
        logger.error(mismatch_message(built, found))
    elif settings.declared_layout is not None or settings.declared_layout_fingerprint:
        logger.info("KVPoolConnector: the declared KV layout is the one vLLM built (%s)", fingerprint(built))
    return LayoutVerdict(found, reports_metric=scheduler)


def add_counters(data: dict[str, Any], counters: dict[str, float]) -> dict[str, Any]:
    """``counters`` added into a stats payload (``vllm_metrics.records_to_data``'s shape)."""
    merged = data.setdefault("counters", {})
    for key, value in counters.items():
        merged[key] = merged.get(key, 0.0) + value
    return data


class OutOfPool:
    """The pool client of a connector that stays out of the pool: it connects to nothing.

    Registering memory does nothing; any transfer would be a bug (the scheduler side
    plans none), so it raises.
    """

    batch_size = 1

    def register(self, ptr: int, size: int) -> None:
        return None

    def close(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"KVPoolConnector stays out of the pool (layout mismatch): no {name}")
