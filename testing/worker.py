"""A real ``WorkerSide`` for tests that drive one rank's transfers without an engine."""

from __future__ import annotations

from typing import Any

from kvpool.connector.contract.keys import KeySpace
from kvpool.connector.records import StatsCollector
from kvpool.connector.worker_side import WorkerSide


def single_group_worker(
    client: Any, cache_prefix: str, *, num_blocks: int, fingerprint: str = "fp", **options: Any
) -> WorkerSide:
    """Rank 0 of one full-attention group whose one layer is ``l0``; ``options`` go to ``WorkerSide``."""
    return WorkerSide(
        client=client,
        keyspace=KeySpace(cache_prefix, fingerprint),
        tp_rank=0,
        pp_rank=0,
        group_layers=[["l0"]],
        num_blocks=num_blocks,
        stats=StatsCollector(group_kinds=("full",)),
        **options,
    )
