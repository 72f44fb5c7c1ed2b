"""Worker half of the connector: move blocks between vLLM's cache and the pool.

Loads and saves run on a small thread pool, off the forward pass, in bounded
batches, zero-copy from and into the registered KV-cache memory. Each key's
return code is classified; a failed load is reported so vLLM recomputes it
(block ids for single-group layouts, the request for hybrid ones). Saves of a
step run while the scheduler prepares the next one; the next forward starts
only once they have read their blocks (those blocks may then be reused).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from kvpool.connector import tracing
from kvpool.connector.block_regions import LayerBlocks, describe_layer, storage_span
from kvpool.connector.contract.keys import KeySpace
from kvpool.connector.logs import get_logger
from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestLoad, RequestSave
from kvpool.connector.pool_client import Outcome, PoolClient, classify
from kvpool.connector.records import StatsCollector, TransferRecord

logger = get_logger(__name__)

TRANSFER_THREADS = 4
SHUTDOWN_TIMEOUT_S = 30.0


@dataclass
class GroupResult:
    """Outcome of one group's transfer for one request."""

    blocks: int = 0
    bytes: int = 0
    failed_block_ids: list[int] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    attempted: bool = False


class WorkerSide:
    """Worker-process state of ``KVPoolConnector``."""

    def __init__(
        self,
        *,
        client: PoolClient,
        keyspace: KeySpace,
        tp_rank: int,
        pp_rank: int,
        group_layers: list[list[str]],
        num_blocks: int,
        stats: StatsCollector,
    ):
        self.client = client
        self.keyspace = keyspace
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        self.group_layers = group_layers
        self.num_blocks = num_blocks
        self.stats = stats
        self.groups: list[list[LayerBlocks]] = [[] for _ in group_layers]
        self._pool = ThreadPoolExecutor(TRANSFER_THREADS, thread_name_prefix="kvpool-xfer")
        self._lock = threading.Lock()
        self._saves_in_flight: list[Future[None]] = []
        self._async_loads: dict[str, Future[bool]] = {}
        self._load_errors: set[int] = set()
        self._closed = False

    # --- registration --------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        """Address every layer's blocks per group; register each memory span once."""
        spans: set[tuple[int, int]] = set()
        for group_id, layer_names in enumerate(self.group_layers):
            for name in layer_names:
                tensor = kv_caches.get(name)
                if tensor is None:  # a layer of another pipeline stage
                    continue
                self.groups[group_id].append(describe_layer(tensor, self.num_blocks))
                spans.add(storage_span(tensor))
        for ptr, size in sorted(spans):
            self.client.register(ptr, size)
        logger.info(
            "KVPoolConnector registered %d memory span(s); bytes per block by group: %s",
            len(spans),
            [self.group_block_bytes(g) for g in range(len(self.groups))],
        )

    def group_block_bytes(self, group_id: int) -> int:
        return sum(layer.block_bytes for layer in self.groups[group_id])

    def _scatter_list(self, group_id: int, block_id: int) -> tuple[list[int], list[int]]:
        ptrs: list[int] = []
        sizes: list[int] = []
        for layer in self.groups[group_id]:
            for ptr, size in layer.regions(block_id):
                ptrs.append(ptr)
                sizes.append(size)
        return ptrs, sizes

    # --- per step -------------------------------------------------------------
    def before_forward(self) -> None:
        """Barrier: saves of earlier steps must finish reading before blocks are reused."""
        with self._lock:
            pending, self._saves_in_flight = self._saves_in_flight, []
        if pending:
            wait(pending)

    def start_loads(self, meta: PoolConnectorMetadata) -> None:
        """Run synchronous loads now; start asynchronous ones in the background."""
        sync_jobs = []
        for load in meta.loads:
            if load.is_async:
                future = self._pool.submit(self._load_request, load)
                with self._lock:
                    self._async_loads[load.req_id] = future
            else:
                sync_jobs.append(self._pool.submit(self._load_request, load))
        for job in sync_jobs:
            job.result()

    def start_saves(self, meta: PoolConnectorMetadata) -> None:
        """Start this step's saves; they complete off the forward path."""
        for save in meta.saves:
            future = self._pool.submit(self._save_request, save)
            with self._lock:
                self._saves_in_flight.append(future)

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished receiving, failed receiving) since the last call.

        A request finished (aborted) while its load ran is freed by vLLM on its
        finished receiving; there is nothing to report as sent: saves keep no
        blocks past the next forward (see ``before_forward``).
        """
        finished_recving: set[str] = set()
        failed_recving: set[str] = set()
        with self._lock:
            for req_id, future in list(self._async_loads.items()):
                if future.done():
                    del self._async_loads[req_id]
                    finished_recving.add(req_id)
                    if not future.result():
                        failed_recving.add(req_id)
        return finished_recving, failed_recving

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # --- transfers ----------------------------------------------------------------
    def _transfer_group(self, op: str, transfer: GroupTransfer) -> GroupResult:
        result = GroupResult()
        if not transfer.block_ids or not self.groups[transfer.group_id]:
            return result
        started = time.perf_counter()
        result.attempted = True
        try:
            codes = self._move(op, transfer)
        except Exception:  # never let a transfer bug reach the forward pass
            logger.exception("KVPoolConnector %s failed for group %d", op, transfer.group_id)
            codes = [None] * len(transfer.block_ids)
        expected = self.group_block_bytes(transfer.group_id)
        for block_id, code in zip(transfer.block_ids, codes):
            outcome = Outcome.OTHER if code is None else classify(code, expected if op == "load" else None)
            if outcome is Outcome.OK or (op == "save" and code is not None and _already_stored(code)):
                result.blocks += 1
                result.bytes += expected
            else:
                result.failures[outcome.value] += 1
                result.failed_block_ids.append(block_id)
        result.seconds = time.perf_counter() - started
        return result

    def _move(self, op: str, transfer: GroupTransfer) -> list[int]:
        """One bounded-batch Mooncake call per group: per-key codes."""
        keys = [self.keyspace.key(transfer.group_id, self.tp_rank, self.pp_rank, d) for d in transfer.digests]
        ptrs, sizes = [], []
        for block_id in transfer.block_ids:
            p, s = self._scatter_list(transfer.group_id, block_id)
            ptrs.append(p)
            sizes.append(s)
        if op == "load":
            return self.client.get_into(keys, ptrs, sizes)
        return self.client.put_from(keys, ptrs, sizes)

    def _traced_group(self, op: str, transfer: GroupTransfer) -> GroupResult:
        """One group's transfer as a child span of the request's."""
        with tracing.span(
            f"kvpool.{op}.group",
            group=transfer.group_id,
            group_kind=self.stats.group_kinds[transfer.group_id] if self.stats.group_kinds else None,
            masked_blocks=transfer.masked,
        ) as span:
            result = self._transfer_group(op, transfer)
            tracing.set_attributes(span, blocks=result.blocks, bytes=result.bytes)
            tracing.mark_failed(span, result.failures)
        return result

    def _load_request(self, load: RequestLoad) -> bool:
        """Load one request's blocks; False when the request must recompute instead."""
        started = time.perf_counter()
        with tracing.span(
            "kvpool.load", load.trace_context, request_id=load.req_id, hit_tokens=load.hit_tokens
        ) as span:
            results = [self._traced_group("load", g) for g in load.groups]
            tracing.mark_failed(span, sum((r.failures for r in results), Counter()))
        failed = [b for r in results for b in r.failed_block_ids]
        # vLLM takes block-level load errors for single-group layouts only; a
        # hybrid request (always loaded asynchronously) is sent back whole.
        recovered_by_request = bool(failed) and len(self.groups) > 1
        if failed and not recovered_by_request:
            with self._lock:
                self._load_errors.update(failed)
        self._record(
            "load",
            load.groups,
            results,
            started,
            0 if recovered_by_request else len(failed),
            recovered_by_request,
        )
        return not recovered_by_request

    def _save_request(self, save: RequestSave) -> None:
        started = time.perf_counter()
        with tracing.span("kvpool.save", save.trace_context, request_id=save.req_id) as span:
            results = [self._traced_group("save", g) for g in save.groups]
            tracing.mark_failed(span, sum((r.failures for r in results), Counter()))
        self._record("save", save.groups, results, started, 0, False)

    def _record(
        self,
        op: str,
        transfers: list[GroupTransfer],
        results: list[GroupResult],
        started: float,
        load_errors: int,
        recomputed: bool,
    ) -> None:
        failures: Counter[str] = Counter()
        for r in results:
            failures.update(r.failures)
        self.stats.record_transfer(
            TransferRecord(
                operation=op,
                group_kinds=self.stats.group_kinds,
                blocks=tuple(r.blocks for r in results),
                masked=tuple(t.masked for t in transfers),
                bytes=tuple(r.bytes for r in results),
                failures=dict(failures),
                seconds=time.perf_counter() - started,
                group_failures=tuple(dict(r.failures) for r in results),
                group_seconds=tuple(r.seconds for r in results),
                group_attempted=tuple(r.attempted for r in results),
                load_error_blocks=load_errors,
                recomputed=recomputed,
            )
        )

    # --- teardown -------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            pending = list(self._saves_in_flight) + list(self._async_loads.values())
        if pending:
            wait(pending, timeout=SHUTDOWN_TIMEOUT_S)
        self._pool.shutdown(wait=True, cancel_futures=True)


def _already_stored(code: int) -> bool:
    # Mooncake keeps the first value of a key; a second put of the same block
    # (same bytes by construction of the key) is not a failure.
    return code == -705
