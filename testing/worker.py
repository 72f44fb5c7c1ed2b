"""A real ``WorkerSide`` for tests that drive one rank's transfers without an engine."""

from __future__ import annotations

from typing import Any

from kvpool.connector.contract.keys import KeySpace
from kvpool.connector.observability.records import StatsCollector
from kvpool.connector.worker.side import WorkerSide


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


def run_loads(worker: WorkerSide, loads: Any, timeout_s: float = 120.0) -> tuple[set[str], set[str]]:
    """Start ``loads`` (a ``PoolConnectorMetadata`` or a list of ``RequestLoad``) and step
    ``transfer_results`` until every one is reported; (finished, failed) receiving.

    Every load is asynchronous; this is what vLLM's steps do for a request waiting for its
    load. Bounded: past ``timeout_s`` it raises.
    """
    import time

    from kvpool.connector.metadata import PoolConnectorMetadata

    meta = loads if isinstance(loads, PoolConnectorMetadata) else PoolConnectorMetadata(loads=list(loads))
    wanted = {load.req_id for load in meta.loads}
    worker.start_loads(meta)
    finished: set[str] = set()
    failed: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while not wanted <= finished:
        if time.monotonic() > deadline:
            raise TimeoutError(f"loads {sorted(wanted - finished)} not reported in {timeout_s} s")
        done, bad = worker.transfer_results(idle=True)
        finished |= done
        failed |= bad
    return finished, failed


def before_each_load(monkeypatch: Any, action: Any) -> None:
    """Run ``action()`` on the transfer thread at the start of every request's load in this process.

    The one place that wraps the worker's per-request load (a fault fired mid-load: a store
    killed, a master restarted, a load slowed); ``monkeypatch.undo()`` removes it.
    """
    original = WorkerSide._load_request

    def load_after_action(self: WorkerSide, *args: Any, **kwargs: Any) -> bool:
        action()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(WorkerSide, "_load_request", load_after_action)


def before_each_save(monkeypatch: Any, action: Any) -> None:
    """Run ``action()`` on the transfer thread at the start of every request's save in this process
    (a fault fired mid-save); ``monkeypatch.undo()`` removes it."""
    original = WorkerSide._save_request

    def save_after_action(self: WorkerSide, *args: Any, **kwargs: Any) -> Any:
        action()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(WorkerSide, "_save_request", save_after_action)


def unreleased_saves(worker: WorkerSide) -> list[Any]:
    """The saves that still hold the step's blocks (the save barrier waits on them)."""
    return list(worker._unreleased_saves)


def transfer_records(worker: WorkerSide) -> list[Any]:
    """The worker's transfer records so far, taken under its statistics lock."""
    with worker.stats._lock:
        return list(worker.stats.transfers)


def staging_slot(worker: WorkerSide) -> Any:
    """The calling thread's staging buffer (registering one on first use); None while every spare rests."""
    return worker._slot()


def retire_staging_slot(worker: WorkerSide) -> None:
    """Retire the calling thread's staging buffer, as a call given up on does."""
    worker._retire_slot()


def resting_slots(worker: WorkerSide) -> list[Any]:
    """The staging buffers retired and resting, oldest first."""
    return [slot for _, slot in worker._retired]


def staging_slots(worker: WorkerSide) -> list[Any]:
    """Every staging buffer the worker allocated."""
    return list(worker._slots)


def loads_in_flight(worker: WorkerSide) -> dict[str, Any]:
    """Each request's load future, by request id (the worker's own dict: tests may plant entries)."""
    return worker._async_loads


def transfer_threads(worker: WorkerSide) -> Any:
    """The worker's transfer thread pool (``ThreadPoolExecutor``)."""
    return worker._pool


def transfers_in_flight(worker: WorkerSide) -> list[Any]:
    """The futures of every save and load in flight, taken under the worker's lock."""
    with worker._lock:
        return list(worker._saves_in_flight) + list(worker._async_loads.values())
