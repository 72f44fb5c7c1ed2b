"""Worker half of the connector: move blocks between vLLM's cache and the pool.

Loads and saves run on a small thread pool, off the forward pass, in bounded
batches. Every object is ``header | payload`` and moves through the transfer
thread's registered staging buffer (:mod:`kvpool.connector.worker.staging`): a save
copies its blocks there, then reserves, writes and publishes its objects; a
load reads objects there, checks each header, and only then copies the payload
into the blocks (a long load reads its next batch into the buffer's other half
meanwhile). Each key's return code is classified; a failed load is
reported so vLLM recomputes it (block ids for one full-attention group, the request
for any other layout), and an object whose header or payload is wrong is removed from the pool.

Every wait has a deadline (:mod:`kvpool.connector.integrity.deadlines`): a load without
progress for ``load_timeout_s`` fails, a save for ``save_timeout_s`` is
abandoned and publishes nothing more, and the next forward waits for earlier
saves only until they have copied their blocks (or are abandoned). A call the
connector gave up on may stay stuck in Mooncake until Mooncake's own timeouts
end it, but it touches nothing but its thread's staging buffer; meanwhile new
transfers fail at once.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kvpool.connector.contract.keys import KeySpace
from kvpool.connector.contract.metric_names import REMOVE
from kvpool.connector.contract.object_header import (
    HEADER_BYTES,
    ObjectIdentity,
    mismatch,
    pack_header,
    stated_checksum,
)
from kvpool.connector.contract.payload_checks import Checksum
from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.contract.shards import shard_of, writes_shard
from kvpool.connector.cpu_affinity import unpin_this_thread
from kvpool.connector.integrity.deadlines import IDLE_STEP_WAIT_S, Job, JobBoard
from kvpool.connector.integrity.device_order import Marker, TransferOrder
from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestLoad, RequestSave
from kvpool.connector.observability import tracing
from kvpool.connector.observability.logs import get_logger
from kvpool.connector.observability.records import StatsCollector, TransferRecord
from kvpool.connector.pool_client import (
    CODE_BUFFER_TOO_SMALL,
    CODE_OBJECT_EXISTS,
    CODE_TRANSFER_FAILED,
    Outcome,
    PoolClient,
    StoreUnavailable,
    classify,
)
from kvpool.connector.worker.block_regions import LayerBlocks, describe_layer, storage_span
from kvpool.connector.worker.staging import GroupCopier, StagingSlot

logger = get_logger(__name__)
_DEFAULTS = ConnectorSettings.model_fields

# The defaults of the ``transfer_threads`` and ``load_batch_bytes`` settings.
TRANSFER_THREADS: int = _DEFAULTS["transfer_threads"].default
# Mooncake's longest wait for a call's transfers (``TransferEngineOperationState::
# wait_for_completion``): a call that returns sooner returns once every transfer of it has
# ended (completed or failed, its connection dropped), so nothing writes or reads its
# buffer any more; a call cut off at this limit may leave its transport moving bytes.
MOONCAKE_TRANSFER_WAIT_S = 60.0
# Staging buffers of a job given up on that ran that long rest this long (ten times
# Mooncake's limit) before reuse; at most one per transfer thread rests at once.
RETIRE_GRACE_S = 600.0
# Keys of one failed read whose size is asked for (an object of the wrong size fails the
# read like a transfer error does): a stored object of another size is not the block.
SIZE_PROBES_PER_CALL = 16

# A load reads batches of about this many bytes, one into each half of its staging buffer
# while the other half is checked and copied into the blocks, when its client holds a
# segment of the pool (most hits local copies). Both halves fit in a last-level cache
# (32 MiB here), so the check and the copy read what Mooncake's copy just wrote from the
# cache. Measured (co-located, 2 x 48 MiB, 2 cores, paired in one run): 4 MiB batches
# 0.54x memcpy, 2 MiB 0.49-0.52x, 16 MiB 0.41-0.43x; against one read a group 1.15-1.38x
# faster with 4 MiB, 1.10-1.14x with 16 MiB (benchmarks.transfer). Over TCP smaller calls
# cost more than the overlap saves, so a client without a segment reads at once.
LOAD_BATCH_BYTES: int = _DEFAULTS["load_batch_bytes"].default


def read_ahead_bytes(segment_bytes: int, batch_bytes: int = LOAD_BATCH_BYTES) -> int | None:
    """The load batch of a worker whose client contributes ``segment_bytes``; None: no read-ahead."""
    return batch_bytes if segment_bytes > 0 and batch_bytes > 0 else None


def load_batches(
    count: int, object_bytes: int, buffer_bytes: int, batch_bytes: int | None
) -> tuple[int, int]:
    """Objects per read and buffer halves used for a load of ``count`` objects.

    One half (no read-ahead) when ``batch_bytes`` is None, everything fits it, or the
    buffer holds fewer than two objects; else two halves, each at most half the buffer.
    """
    fits = max(1, buffer_bytes // object_bytes)
    if batch_bytes is None or count * object_bytes <= batch_bytes or fits < 2:
        return min(count, fits), 1
    return max(1, min(fits // 2, batch_bytes // object_bytes)), 2


@dataclass(frozen=True)
class Deadlines:
    """The worker's deadlines, in seconds (the ``*_timeout_s`` connector settings)."""

    load_s: float = _DEFAULTS["load_timeout_s"].default
    save_s: float = _DEFAULTS["save_timeout_s"].default
    shutdown_s: float = _DEFAULTS["shutdown_timeout_s"].default

    @classmethod
    def of(cls, settings: ConnectorSettings) -> Deadlines:
        return cls(settings.load_timeout_s, settings.save_timeout_s, settings.shutdown_timeout_s)


@dataclass
class GroupResult:
    """Outcome of one group's transfer for one request."""

    blocks: int = 0
    bytes: int = 0
    failed_block_ids: list[int] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    attempted: bool = False
    corrupt_keys: list[str] = field(default_factory=list)
    direct_blocks: int = 0  # blocks loaded straight from this process's own segment
    held_bytes: int = 0  # of a save's blocks the pool already held: stored, none of it moved

    def fail(self, block_ids: Sequence[int], outcome: Outcome | str) -> None:
        self.failures[str(outcome)] += len(block_ids)
        self.failed_block_ids.extend(block_ids)


@dataclass
class StagedGroup:
    """A group of a save staged with the others before any of them is written: its objects
    (headers included) in ``slot``, a part of the thread's buffer; None when staging failed
    (``result`` says how)."""

    result: GroupResult
    slot: StagingSlot | None
    seconds: float = 0.0


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
        tp_size: int = 1,
        group_shards: Sequence[int] = (),
        num_blocks: int,
        stats: StatsCollector,
        deadlines: Deadlines | None = None,
        staging_bytes: int = _DEFAULTS["staging_buffer_size"].default,
        order: TransferOrder | None = None,
        load_batch_bytes: int | None = None,
        transfer_threads: int = TRANSFER_THREADS,
        idle_step_wait_s: float = IDLE_STEP_WAIT_S,
        device_path: bool | None = None,
        direct_local_loads: bool = False,
        failures_by_request: bool | None = None,
    ):
        self.client = client
        self.keyspace = keyspace
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        self.group_layers = group_layers
        # Per group: the shard this rank holds (its keys and headers name it) and whether it is
        # the shard's lowest rank, the one that saves it (contract.shards); one per rank if unset.
        shards = tuple(group_shards) or tuple(tp_size for _ in group_layers)
        self.shards = tuple(shard_of(tp_rank, tp_size, n) for n in shards)
        self.writes = tuple(writes_shard(tp_rank, tp_size, n) for n in shards)
        self.num_blocks = num_blocks
        self.stats = stats
        self.deadlines = deadlines or Deadlines()
        self.staging_bytes = staging_bytes
        # A load's read-ahead batch (``read_ahead_bytes``); None: each read fills the buffer.
        self.load_batch_bytes = load_batch_bytes
        self.groups: list[list[LayerBlocks]] = [[] for _ in group_layers]
        # A failed load goes back to vLLM as its request (recomputed whole), not as block ids
        # (recomputed from the first failed block): always but for one full-attention group
        # (``KVLayout.recovers_failed_loads_by_block``); unset: for more than one group.
        by_request = failures_by_request
        self.failures_by_request = len(group_layers) > 1 if by_request is None else by_request
        self.copiers: list[GroupCopier | None] = [None for _ in group_layers]
        self._device: Any = None
        # None: the device path where the KV cache is on an accelerator; True: on CPU tensors too.
        self.device_path = device_path
        # At most one staging buffer per transfer thread rests after a call given up on.
        self.retired_max = transfer_threads
        self.idle_step_wait_s = idle_step_wait_s
        # Objects in the client's own segment load straight into host blocks (checked there);
        # a client without a segment answers that none are there, without asking the master.
        self.direct_local_loads = direct_local_loads
        # Transfers touch blocks only after the device work queued before them.
        self.order = order or TransferOrder()
        self._pool = ThreadPoolExecutor(
            transfer_threads, thread_name_prefix="kvpool-xfer", initializer=self._enter_transfer_thread
        )
        # One read-ahead in flight per transfer thread at most: the next batch of its load.
        self._fetchers = ThreadPoolExecutor(
            transfer_threads, thread_name_prefix="kvpool-fetch", initializer=unpin_this_thread
        )
        self._lock = threading.Lock()
        # Futures of saves and asynchronous loads not yet returned (their records follow).
        self._saves_in_flight: list[Future[None]] = []
        self._async_loads: dict[str, Future[bool]] = {}
        # Saves the next forward waits for, until they have copied their blocks.
        self._unreleased_saves: list[Job] = []
        self._async_jobs: dict[str, tuple[RequestLoad, Job]] = {}
        self.jobs = JobBoard()  # every transfer in flight, with its deadline
        self._job_of: dict[int, Job] = {}  # id(RequestLoad | RequestSave) -> its job
        self._futures: dict[Job, Future[Any]] = {}  # of jobs submitted and not yet returned
        self._queued_saves: dict[Job, RequestSave] = {}  # saves submitted and not yet started
        self._load_errors: set[int] = set()
        self._local = threading.local()
        self._slots: list[StagingSlot] = []  # every staging buffer allocated (and registered)
        self._idle_slots: list[StagingSlot] = []  # allocated at registration, no thread's yet
        self.transfer_threads = transfer_threads
        self._retired: list[tuple[float, StagingSlot]] = []  # (when, buffer) given up on
        self._closed = False
        # The KV caches' memory registered with the client: unregistered at shutdown with
        # the staging buffers, as the client may outlive this engine in the process.
        self._kv_spans: list[tuple[int, int]] = []
        # Per save job: a marker after its queued reads of its blocks (device path), for the barrier.
        self._blocks_read: dict[Job, Marker] = {}

    # --- registration --------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        """Address every layer's blocks per group; register each memory span once."""
        spans: set[tuple[int, int]] = set()
        for group_id, layer_names in enumerate(self.group_layers):
            tensors = []
            for name in layer_names:
                tensor = kv_caches.get(name)
                if tensor is None:  # a layer of another pipeline stage
                    continue
                self.groups[group_id].append(describe_layer(tensor, self.num_blocks))
                tensors.append(tensor)
                spans.add(storage_span(tensor))
                self._device = tensor.device
            if tensors:
                self.copiers[group_id] = GroupCopier(
                    self.groups[group_id], tensors, use_memmove=not self._on_device_path(tensors[0])
                )
            else:  # every layer of the group is on other pipeline stages
                self.copiers[group_id] = GroupCopier.header_only(self.num_blocks)
        for ptr, size in sorted(spans):
            self.client.register(ptr, size)
            self._kv_spans.append((ptr, size))
        self._allocate_staging()
        logger.info(
            "KVPoolConnector registered %d memory span(s); bytes per block by group: %s; "
            "staging: %d x %d bytes on %s",
            len(spans),
            [self.group_block_bytes(g) for g in range(len(self.groups))],
            len(self._idle_slots),
            self.slot_bytes(),
            self._device,
        )

    def slot_bytes(self) -> int:
        """One staging buffer's size: ``staging_buffer_size``, or one object if that is larger."""
        largest = max((c.object_bytes for c in self.copiers if c is not None), default=0)
        return max(self.staging_bytes, largest)

    def _allocate_staging(self) -> None:
        """One staging buffer per transfer thread, allocated and registered now, with the KV
        caches: on an accelerator the memory is taken once, at startup, never by a first
        transfer (``docs/architecture.md``: how it relates to vLLM's memory budget)."""
        if self._device is None:
            return  # no layer on this rank
        for _ in range(self.transfer_threads):
            self._idle_slots.append(self._new_slot())

    def _new_slot(self) -> StagingSlot:
        slot = StagingSlot(self.slot_bytes(), self._device, device_path=bool(self.device_path))
        self.client.register(slot.ptr, slot.nbytes)
        with self._lock:
            self._slots.append(slot)
        return slot

    def _on_device_path(self, tensor: Any) -> bool:
        """Whether copies and checksums take the device path for a cache like ``tensor``."""
        return self.device_path if self.device_path is not None else tensor.device.type != "cpu"

    def group_block_bytes(self, group_id: int) -> int:
        return sum(layer.block_bytes for layer in self.groups[group_id])

    def memory_runs(self, group_id: int, block_id: int) -> tuple[list[int], list[int]]:
        """Every memory run of one block, in object order (the staging copies use the same order)."""
        ptrs: list[int] = []
        sizes: list[int] = []
        for layer in self.groups[group_id]:
            for ptr, size in layer.regions(block_id):
                ptrs.append(ptr)
                sizes.append(size)
        return ptrs, sizes

    def _staging_for(
        self, transfer: GroupTransfer, copier: GroupCopier, result: GroupResult
    ) -> StagingSlot | None:
        """This thread's staging buffer for a group's transfer, or None with every block failed
        (``timeout``) while every spare buffer is retired: no call until one is free again."""
        result.attempted = True
        copier.check(transfer.block_ids)
        slot = self._slot()
        if slot is None:
            result.fail(transfer.block_ids, Outcome.TIMEOUT)
        return slot

    def _slot(self) -> StagingSlot | None:
        """This transfer thread's staging buffer, registered on first use; None while none may be used.

        A buffer whose call was given up on is retired (see ``_retire_slot``): the
        thread takes a retired one whose grace has passed, or a new one while fewer
        than ``retired_max`` are retired.
        """
        slot: StagingSlot | None = getattr(self._local, "slot", None)
        if slot is not None:
            return slot
        with self._lock:
            now = time.monotonic()
            ready = [entry for entry in self._retired if now - entry[0] >= RETIRE_GRACE_S]
            if ready:
                self._retired.remove(ready[0])
                slot = ready[0][1]
            elif self._idle_slots:
                slot = self._idle_slots.pop()
            elif len(self._retired) >= self.retired_max:
                return None
        if slot is None:  # a thread whose buffer was retired: one more, until it is free again
            slot = self._new_slot()
        self._local.slot = slot
        return slot

    def _retire_slot(self) -> None:
        """Retire this thread's buffer after a job that may hold a call cut off at Mooncake's limit.

        Mooncake may end a call at its own hard limit (``MOONCAKE_TRANSFER_WAIT_S``)
        while its transport still moves bytes; only ``RETIRE_GRACE_S`` later is the
        buffer used again.
        """
        slot: StagingSlot | None = getattr(self._local, "slot", None)
        if slot is not None:
            self._local.slot = None
            with self._lock:
                self._retired.append((time.monotonic(), slot))

    def _enter_transfer_thread(self) -> None:
        """A transfer thread's start: its CPU affinity, and its own device stream."""
        unpin_this_thread()
        self.order.enter_transfer_thread()

    # --- per step -------------------------------------------------------------
    def before_forward(self) -> None:
        """Barrier: saves of earlier steps must have copied their blocks before blocks are reused.

        On the CPU a save is released once its copies are done; on the device path once
        they are queued on its transfer stream, and the engine's stream then waits for them
        (``TransferOrder.before_block_writes``): the host never waits for the device here.
        Bounded: a save that has not copied them ``save_timeout_s`` after its last
        progress is abandoned (it copies nothing afterwards and publishes nothing).
        Saves that copied their blocks but are overdue in the pool are abandoned too.
        """
        with self._lock:
            pending, self._unreleased_saves = self._unreleased_saves, []
            self._saves_in_flight = [f for f in self._saves_in_flight if not f.done()]
        for job in pending:
            if not job.wait(until_released=True):
                job.abandon()
        with self._lock:
            blocks_read = [self._blocks_read.pop(job) for job in pending if job in self._blocks_read]
        self.order.before_block_writes(blocks_read)
        self.jobs.abandon_overdue([j for j in self.jobs.live() if j.kind == "save"])

    def wait_for_saves(self) -> None:
        """Until every save in flight has published (or passed its deadline and been abandoned).

        The forward never waits for this (see ``before_forward``); shutdown,
        tests and benchmarks do.
        """
        for job in self.jobs.live():
            if job.kind == "save" and not job.wait():
                job.abandon()

    def start_loads(self, meta: PoolConnectorMetadata) -> None:
        """Start this step's loads; each is reported by ``transfer_results`` once it returned
        or passed its deadline. The forward never waits for a load: its request is not
        scheduled (and its blocks are not cached) until the load is reported."""
        zeroed = self.order.before_loads(meta.loads)
        stalled = self.jobs.stalled
        for load in meta.loads:
            job = Job("load", self.deadlines.load_s)
            with self._lock:
                self._async_jobs[load.req_id] = (load, job)
            if load.refused:
                job.finish(False)  # reported failed: the request recomputes
            elif stalled:
                # A call the connector gave up on is still stuck: do not queue behind it.
                job.abandon()
                self._load_abandoned(load, job, ran=False)
            else:
                future = self._submit(job, load, partial(self._load_request, after=zeroed))
                with self._lock:
                    self._async_loads[load.req_id] = future

    def start_saves(self, meta: PoolConnectorMetadata) -> None:
        """Start this step's saves; they copy their blocks, then complete off the forward path."""
        stalled = self.jobs.stalled
        save_after_forward = partial(self._save_after_forward, forward_done=self.order.forward_done())
        for save in meta.saves:
            job = Job("save", self.deadlines.save_s)
            if stalled:
                job.abandon()
                results = [self._not_saved(g, _timed_out) for g in save.groups]
                self._record("save", save.req_id, save.groups, results, time.perf_counter())
                continue
            future = self._submit(job, save, save_after_forward)
            with self._lock:
                self._saves_in_flight.append(future)
                self._unreleased_saves.append(job)
        if self.order.drain_saves:
            self.before_forward()

    def drop_saves(self, meta: PoolConnectorMetadata) -> None:
        """This step's saves are not made: its forward raised, so its blocks may hold anything
        (stale bytes under a valid header and checksum would pass every load check)."""
        now = time.perf_counter()
        blocks = 0
        for save in meta.saves:
            results = [
                self._not_saved(g, partial(_failed, outcome=Outcome.FORWARD_FAILED)) for g in save.groups
            ]
            blocks += sum(len(g.block_ids) for g in save.groups)
            self._record("save", save.req_id, save.groups, results, now)
        logger.warning(
            "KVPoolConnector: the step's forward raised; its %d save(s) of %d block(s) are not made",
            len(meta.saves),
            blocks,
        )

    def _not_saved(
        self, transfer: GroupTransfer, failed: Callable[[GroupTransfer], GroupResult]
    ) -> GroupResult:
        """A group of a save not made: failed as ``failed`` says where this rank saves it (its
        keys), nothing where another rank of its shard does or it holds none of the group."""
        return failed(transfer) if self._saves_group(transfer.group_id) else GroupResult()

    def _save_after_forward(self, save: RequestSave, forward_done: Marker | None) -> None:
        """A save whose reads of its blocks are queued after the forward that computed them."""
        self.order.after(forward_done)
        self._save_request(save)

    def transfer_results(self, *, idle: bool = False) -> tuple[set[str], set[str]]:
        """(finished receiving, failed receiving) since the last call.

        ``idle``: this step ran no forward (see ``_pace_idle_step``).

        An asynchronous load without progress for ``load_timeout_s`` is given up
        here: reported finished and failed, so its request recomputes; the call
        still stuck writes only its staging buffer. A request finished (aborted)
        while its load ran is freed by vLLM on its finished receiving; there is
        nothing to report as sent: saves keep no blocks past the next forward
        (see ``before_forward``).
        """
        finished_recving: set[str] = set()
        failed_recving: set[str] = set()
        if idle:
            self._pace_idle_step()
        with self._lock:
            jobs = list(self._async_jobs.items())
        for req_id, (load, job) in jobs:
            if not job.done and not job.abandoned:
                if not job.overdue() or not job.abandon():
                    continue
                self._load_abandoned(load, job)
            with self._lock:
                self._async_jobs.pop(req_id, None)
                self._async_loads.pop(req_id, None)
            finished_recving.add(req_id)
            # A load of one full-attention group fails by block ids (take_load_errors); any
            # other request is sent back whole.
            if (job.done and not job.result) or (job.abandoned and self.failures_by_request):
                failed_recving.add(req_id)
        return finished_recving, failed_recving

    def _pace_idle_step(self) -> None:
        """Wait up to ``idle_step_wait_s`` for an asynchronous load in flight to return.

        An engine whose only work is waiting for loads steps back to back; the
        pause releases the GIL to the transfer threads, and ends as soon as one
        load returns, which is then reported in this step.
        """
        with self._lock:
            in_flight = [f for f in self._async_loads.values() if not f.done()]
        if in_flight:
            wait(in_flight, timeout=self.idle_step_wait_s, return_when=FIRST_COMPLETED)

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def _submit(self, job: Job, request: RequestLoad | RequestSave, fn: Any) -> Future[Any]:
        self.jobs.add(job)
        with self._lock:
            self._job_of[id(request)] = job

        def run() -> Any:
            started = time.monotonic()
            with self._lock:
                self._queued_saves.pop(job, None)
            try:
                return fn(request)
            finally:
                # Every Mooncake call of the job ran within its run: one that returned before
                # Mooncake's limit left nothing moving, and its buffer is used again at once. A
                # job that ran that long may hold a call cut off at the limit, given up on or
                # not (an engine that takes no step gives nothing up): its buffer rests.
                if time.monotonic() - started >= MOONCAKE_TRANSFER_WAIT_S:
                    self._retire_slot()
                job.returned()
                self._forget(job, request)

        with self._lock:
            if isinstance(request, RequestSave):
                self._queued_saves[job] = request
        future = self._pool.submit(run)
        with self._lock:
            self._futures[job] = future
        future.add_done_callback(lambda _: self._drop_future(job))
        return future

    def _drop_future(self, job: Job) -> None:
        with self._lock:
            self._futures.pop(job, None)

    def _forget(self, job: Job, request: RequestLoad | RequestSave | None = None) -> None:
        """A job that returned (or never ran) leaves the board."""
        self.jobs.remove(job)
        if request is not None:
            with self._lock:
                self._job_of.pop(id(request), None)

    def _job(self, request: RequestLoad | RequestSave, timeout_s: float) -> Job:
        """The job of ``request`` (a fresh one when it was not submitted by this class)."""
        with self._lock:
            job = self._job_of.get(id(request))
        kind = "load" if isinstance(request, RequestLoad) else "save"
        return job if job is not None else Job(kind, timeout_s)

    # --- loads -------------------------------------------------------------------
    def _load_request(self, load: RequestLoad, after: Marker | None = None) -> bool:
        """Load one request's blocks; False when the request must recompute instead.

        ``after``: the device work the load's writes into the blocks are queued after.
        """
        job = self._job(load, self.deadlines.load_s)
        if job.abandoned:
            return False
        self.order.after(after)
        started = time.perf_counter()
        with tracing.span(
            "kvpool.load", load.trace_context, request_id=load.req_id, hit_tokens=load.hit_tokens
        ) as span:
            results = [self._traced_group("load", g, job) for g in load.groups]
            tracing.mark_failed(span, sum((r.failures for r in results), Counter()))
        failed = [b for r in results for b in r.failed_block_ids]
        # Block ids only for one full-attention group (vLLM takes none for hybrids, and a
        # recompute from inside a window's hit would read its null blocks): else the request.
        recovered_by_request = bool(failed) and self.failures_by_request
        ok = not recovered_by_request
        # Before the failure is reported: the recompute's saves then find the key free.
        self._remove_corrupt(results)
        if job.begin_touch():  # not given up: this outcome, not a timeout, is reported
            try:
                if failed and not recovered_by_request:
                    with self._lock:
                        self._load_errors.update(failed)
                self._record(
                    "load",
                    load.req_id,
                    load.groups,
                    results,
                    started,
                    0 if recovered_by_request else len(failed),
                    recovered_by_request,
                )
            finally:
                job.finish(ok)
        return ok

    def _load_abandoned(self, load: RequestLoad, job: Job, *, ran: bool = True) -> None:
        """Report a load given up at its deadline: what it did not copy is recomputed. Its
        groups' latency is its wait until given up (``ran`` False: failed before it started,
        no latency)."""
        by_request = self.failures_by_request
        waited = job.age() if ran else None
        results = [_timed_out(g, skip=job.copied, seconds=waited) for g in load.groups]
        failed = [b for r in results for b in r.failed_block_ids]
        if failed and not by_request:
            with self._lock:
                self._load_errors.update(failed)
        logger.warning(
            "KVPoolConnector load of %d block(s) made no progress for %.1f s: given up, recomputed",
            len(failed),
            job.timeout_s,
        )
        self._record(
            "load",
            load.req_id,
            load.groups,
            results,
            time.perf_counter(),
            0 if by_request else len(failed),
            by_request,
        )

    def _load_group(self, transfer: GroupTransfer, job: Job) -> GroupResult:
        """One group's blocks: those whose objects are in this process's own segment copied
        straight in (:meth:`_load_direct`, with ``direct_local_loads``), the others batch by
        batch through this thread's staging buffer.

        Reading ahead (``load_batch_bytes`` set), the buffer's two halves alternate:
        while this thread checks one batch and copies it into the blocks, a fetch
        thread reads the next batch into the other half, so Mooncake's copy and the
        connector's overlap. A half is read into again only after the call that wrote
        it returned and its batch was copied, and the group returns only after every
        call it made returned (the buffer is this thread's again).
        """
        copier = self.copiers[transfer.group_id]
        if not transfer.block_ids or copier is None:
            return GroupResult()
        if self.direct_local_loads and copier.use_memmove and copier.runs:
            direct, rest = self._load_direct(transfer, job, copier)
            if direct is not None:  # the objects elsewhere, if any, go through the staging buffer
                return direct if rest is None else self._load_staged(rest, job, copier, direct)
        return self._load_staged(transfer, job, copier, GroupResult())

    def _load_staged(
        self, transfer: GroupTransfer, job: Job, copier: GroupCopier, result: GroupResult
    ) -> GroupResult:
        """``transfer``'s blocks read through this thread's staging buffer (see
        :meth:`_load_group`), counted into ``result`` (the group's, which may hold its direct part)."""
        slot = self._staging_for(transfer, copier, result)
        if slot is None:
            return result
        size = copier.object_bytes
        keys = self._keys(transfer)
        per_call, halves = load_batches(len(keys), size, slot.nbytes, self.load_batch_bytes)
        parts = [slot.part(h * per_call * size, per_call * size) for h in range(halves)]
        starts = list(range(0, len(keys), per_call))

        def fetch(index: int) -> Future[list[int]] | None:
            """Start reading batch ``index`` into its half; None when the job may not."""
            if index >= len(starts) or not job.may_publish():
                return None
            part, first = parts[index % halves], starts[index]
            batch = keys[first : first + per_call]
            ptrs = [[part.ptr + i * size] for i in range(len(batch))]
            if halves == 1:
                done: Future[list[int]] = Future()
                done.set_result(self.client.get_into(batch, ptrs, [[size]] * len(batch)))
                return done
            return self._fetchers.submit(self.client.get_into, batch, ptrs, [[size]] * len(batch))

        pending = fetch(0)
        try:
            for index, first in enumerate(starts):
                if pending is None:
                    result.fail(transfer.block_ids[first:], Outcome.TIMEOUT)
                    break
                codes = pending.result()
                # Two halves: the next batch is read while this one is copied; one: after.
                pending = fetch(index + 1) if halves == 2 else None
                batch = slice(first, first + per_call)
                if not self._take_batch(
                    transfer, job, result, parts[index % halves], first, keys[batch], codes, copier
                ):
                    result.fail(transfer.block_ids[first + per_call :], Outcome.TIMEOUT)
                    break
                if halves == 1:
                    pending = fetch(index + 1)
        finally:
            if pending is not None:  # its half is written until the call returns
                pending.exception()
        return result

    def _load_direct(
        self, transfer: GroupTransfer, job: Job, copier: GroupCopier
    ) -> tuple[GroupResult | None, GroupTransfer | None]:
        """The group's blocks whose objects are in this process's own segment, whole and with
        a CRC-32C header, copied straight into the blocks: (their result, or None when there
        are none; the rest of the group to stage, or None when nothing is left).

        The only copies are memmoves within this process's memory: nothing a frozen peer can
        stall, so the job touches the blocks only while it copies. Each block is checked
        after its copy, from the block itself: a block whose bytes are not as its header
        states is a failed load (recomputed, never cached) and its object is removed.
        """
        keys = self._keys(transfer)
        located = self.client.own_objects(keys)
        size = copier.object_bytes
        address = {i: at[0] for i, at in enumerate(located) if at is not None and at[1] == size}
        if not address:
            return None, transfer
        try:
            # The segment stays mapped while anything of it is read, headers included.
            with self.client.holding_segment():
                headers = {i: ctypes.string_at(at, HEADER_BYTES) for i, at in address.items()}
                own = [i for i in address if stated_checksum(headers[i]) is Checksum.CRC32C]
                if not own:
                    return None, transfer
                whole = len(own) == len(keys)  # the usual case: the group's every object
                direct = self._copy_direct(
                    transfer if whole else _subset(transfer, own),
                    job,
                    copier,
                    keys if whole else [keys[i] for i in own],
                    [address[i] for i in own],
                    [headers[i] for i in own],
                )
        except StoreUnavailable:  # the client closed (shutdown): nothing was read
            return None, transfer
        taken = set(own)
        rest = [i for i in range(len(keys)) if i not in taken]
        return direct, (_subset(transfer, rest) if rest else None)

    def _copy_direct(
        self,
        transfer: GroupTransfer,
        job: Job,
        copier: GroupCopier,
        keys: Sequence[str],
        addresses: Sequence[int],
        headers: Sequence[bytes],
    ) -> GroupResult:
        """Each object at ``addresses`` into its block, checked from the block (see
        :meth:`_load_direct`); nothing once the job was given up."""
        result = GroupResult(attempted=True)
        copier.check(transfer.block_ids)
        if not job.begin_touch():
            result.fail(transfer.block_ids, Outcome.TIMEOUT)
            return result
        result.direct_blocks = len(keys)  # written into the blocks from here on, checked or not
        try:
            for index, (block, address, header) in enumerate(zip(transfer.block_ids, addresses, headers)):
                if mismatch(header, self._identity(transfer, index, copier)) is not None:
                    result.fail([block], Outcome.CORRUPT)
                    result.corrupt_keys.append(keys[index])
                elif copier.into_block_checked(address, block, header):
                    job.copied.add((transfer.group_id, block))
                    result.blocks += 1
                    result.bytes += copier.payload_bytes
                else:
                    result.fail([block], Outcome.CORRUPT)
                    result.corrupt_keys.append(keys[index])
        finally:
            job.end_touch()
        return result

    def _take_batch(
        self,
        transfer: GroupTransfer,
        job: Job,
        result: GroupResult,
        part: StagingSlot,
        first: int,
        batch_keys: Sequence[str],
        codes: Sequence[int],
        copier: GroupCopier,
    ) -> bool:
        """Check a read batch in ``part`` and copy its good objects into the blocks.

        False when the job was given up meanwhile (then nothing of the batch is copied).
        """
        blocks = transfer.block_ids[first : first + len(batch_keys)]
        headers = part.read_headers(len(batch_keys), copier.object_bytes)
        good: list[tuple[int, int]] = []
        unexplained: list[int] = []
        for i, (block, code) in enumerate(zip(blocks, codes)):
            outcome = self._check_loaded(transfer, first + i, code, headers[i], copier)
            if outcome is Outcome.OK:
                good.append((i, block))
            elif code == CODE_TRANSFER_FAILED:
                unexplained.append(i)
            else:
                result.fail([block], outcome)
                if outcome is Outcome.CORRUPT:
                    result.corrupt_keys.append(batch_keys[i])
        wrong_size = self._wrong_sizes([batch_keys[i] for i in unexplained], copier.object_bytes)
        for i in unexplained:
            if batch_keys[i] in wrong_size:
                result.fail([blocks[i]], Outcome.CORRUPT)
                result.corrupt_keys.append(batch_keys[i])
            else:
                result.fail([blocks[i]], Outcome.TRANSFER_FAILED)
        if not job.begin_touch():
            # Given up meanwhile: nothing of this batch reaches the blocks.
            result.fail([b for _, b in good], Outcome.TIMEOUT)
            return False
        try:
            # A payload not as its header states (corrupt, or read before its write landed)
            # fails its block: never reported loaded, so vLLM recomputes it (on the CPU it
            # is checked on the block right after its copy, from the cache, and a block that
            # fails there is zeroed: nothing of the payload stays for the block's next user).
            bad = copier.to_blocks_if_intact(part, good, [headers[i] for i, _ in good])
            for k in bad:
                i, block = good[k]
                result.fail([block], Outcome.CORRUPT)
                result.corrupt_keys.append(batch_keys[i])
            rejected = set(bad)
            good = [pair for k, pair in enumerate(good) if k not in rejected]
            job.copied.update((transfer.group_id, b) for _, b in good)
        finally:
            job.end_touch()
        result.blocks += len(good)
        result.bytes += len(good) * copier.payload_bytes
        return True

    def _check_loaded(
        self, transfer: GroupTransfer, index: int, code: int, header: bytes, copier: GroupCopier
    ) -> Outcome:
        """A read's outcome: its code, and for a whole object its header."""
        if code == copier.object_bytes:
            expected = self._identity(transfer, index, copier)
            return Outcome.OK if mismatch(header, expected) is None else Outcome.CORRUPT
        if code >= 0 or code == CODE_BUFFER_TOO_SMALL:
            return Outcome.CORRUPT  # an object of another size is not this block
        return classify(code)

    def _wrong_sizes(self, keys: Sequence[str], size: int) -> set[str]:
        """Keys among failed reads whose object has another size than ``size``.

        Mooncake fails the read of an object smaller than the buffer like a broken
        transfer; the size of at most ``SIZE_PROBES_PER_CALL`` such keys is asked.
        """
        out = set()
        for key in keys[:SIZE_PROBES_PER_CALL]:
            stored = self.client.size_of(key)
            if stored > 0 and stored != size:
                out.add(key)
        return out

    def _remove_corrupt(self, results: Sequence[GroupResult]) -> None:
        """Remove objects that are not the block their key names: no one loads them again
        (a key a save here is writing meanwhile is left to it: see ``PoolClient.remove``)."""
        if not any(r.corrupt_keys for r in results):
            return
        started = time.perf_counter()
        removed = []
        for r in results:
            codes = self.client.remove(r.corrupt_keys) if r.corrupt_keys else []
            removed.append(sum(1 for code in codes if code == 0))
        logger.warning(
            "KVPoolConnector: %d object(s) failed their check; removed %d (any other: already gone, "
            "leased by a reader, or being written)",
            sum(len(r.corrupt_keys) for r in results),
            sum(removed),
        )
        kinds = self.stats.group_kinds or tuple("" for _ in results)
        zeros = tuple(0 for _ in results)
        self.stats.record_transfer(
            TransferRecord(
                operation=REMOVE,  # counted by metric_names.REMOVED_OBJECTS
                group_kinds=kinds,
                blocks=tuple(removed),
                masked=zeros,
                bytes=zeros,
                failures={},
                seconds=time.perf_counter() - started,
                group_failures=tuple({} for _ in results),
                group_seconds=tuple(0.0 for _ in results),
                group_attempted=tuple(False for _ in results),
                reason=Outcome.CORRUPT.value,
            )
        )

    # --- saves -------------------------------------------------------------------------
    def _save_request(self, save: RequestSave) -> None:
        job = self._job(save, self.deadlines.save_s)
        started = time.perf_counter()
        groups = [g for g in save.groups if g.block_ids and self._saves_group(g.group_id)]
        last = groups[-1] if groups else None
        with tracing.span("kvpool.save", save.trace_context, request_id=save.req_id) as span:
            try:
                staged = self._stage_together(groups, job)
            except Exception:  # never let a transfer bug reach the forward pass: group by group
                logger.exception("KVPoolConnector save could not stage its groups together")
                staged = None
            results = [self._traced_group("save", g, job, g is last, staged) for g in save.groups]
            tracing.mark_failed(span, sum((r.failures for r in results), Counter()))
        self._record("save", save.req_id, save.groups, results, started, 0, False)
        job.finish(True)

    def _stage_together(self, groups: Sequence[GroupTransfer], job: Job) -> dict[int, StagedGroup] | None:
        """Stage every group's objects into one buffer before any is written, so the blocks are
        released (the save barrier) after local copies only; None when the groups do not fit
        together (then each group is staged and written in turn, in batches)."""
        if len(groups) < 2:
            return None  # one group fitting one buffer is released before its write anyway
        copiers = [self.copiers[g.group_id] for g in groups]
        sizes = [len(g.block_ids) * c.object_bytes for g, c in zip(groups, copiers, strict=True) if c]
        slot = self._slot()
        if slot is None or len(sizes) < len(groups) or sum(sizes) > slot.nbytes:
            return None
        staged: dict[int, StagedGroup] = {}
        # Block ids checked first: the last group to copy releases the blocks (the barrier).
        valid = []
        for transfer, copier in zip(groups, copiers, strict=True):
            assert copier is not None
            try:
                copier.check(transfer.block_ids)
                valid.append(transfer.group_id)
            except Exception:  # never let a transfer bug reach the forward pass
                logger.exception("KVPoolConnector save failed to stage group %d", transfer.group_id)
                invalid = GroupResult(attempted=True)
                invalid.fail(transfer.block_ids, Outcome.OTHER)
                staged[transfer.group_id] = StagedGroup(invalid, None)
        # Every group's copies first, the blocks released after the last: on the device path a
        # checksum waits for this thread's stream (behind the step's forward), so none is taken
        # before the release, or the next step's barrier would wait for this step's forward.
        copied: list[tuple[GroupTransfer, GroupCopier, StagingSlot, list[int] | None, float]] = []
        offset = 0
        for transfer, copier, nbytes in zip(groups, copiers, sizes, strict=True):
            assert copier is not None
            part = slot.part(offset, nbytes)
            offset += nbytes
            if transfer.group_id not in valid:
                continue
            started = time.perf_counter()
            if not job.begin_touch():  # given up at its deadline: nothing more is copied or written
                for rest in groups:
                    if rest.group_id not in staged:
                        failed = GroupResult(attempted=True)
                        failed.fail(rest.block_ids, Outcome.TIMEOUT)
                        staged[rest.group_id] = StagedGroup(failed, None)
                return staged
            try:
                checks = None
                if copier.use_memmove:  # each CRC right after its copy, from the core's cache
                    checks = copier.stage(part, transfer.block_ids)
                else:  # queued on this thread's stream; released before the device ran it
                    copier.from_blocks(part, transfer.block_ids, synchronize=False)
                    self._note_blocks_read(job)
                copied.append((transfer, copier, part, checks, time.perf_counter() - started))
            except Exception:  # never let a transfer bug reach the forward pass
                logger.exception("KVPoolConnector save failed to stage group %d", transfer.group_id)
                failed = GroupResult(attempted=True)
                failed.fail(transfer.block_ids, Outcome.OTHER)
                staged[transfer.group_id] = StagedGroup(failed, None)
            finally:
                job.end_touch(last=transfer.group_id == valid[-1])
        for transfer, copier, part, checks, seconds in copied:
            started = time.perf_counter()
            result = GroupResult(attempted=True)
            try:
                size = copier.object_bytes
                if checks is None:  # taken where the bytes are; waits for this thread's stream
                    checks = part.payload_word_sums(range(len(transfer.block_ids)), size)
                identities = [self._identity(transfer, i, copier) for i in range(len(transfer.block_ids))]
                part.write_headers(
                    [pack_header(h, c, copier.checksum) for h, c in zip(identities, checks, strict=True)],
                    size,
                )
                staged[transfer.group_id] = StagedGroup(result, part, seconds + time.perf_counter() - started)
            except Exception:  # never let a transfer bug reach the forward pass
                logger.exception("KVPoolConnector save failed to stage group %d", transfer.group_id)
                result.fail(transfer.block_ids, Outcome.OTHER)
                staged[transfer.group_id] = StagedGroup(result, None)
        return staged

    def _put_together(self, transfer: GroupTransfer, job: Job, staged: StagedGroup) -> GroupResult:
        """Reserve, write and publish a group staged by :meth:`_stage_together`."""
        result, slot = staged.result, staged.slot
        copier = self.copiers[transfer.group_id]
        if slot is None or copier is None:
            return result
        size = copier.object_bytes
        keys = self._keys(transfer)
        replacing = getattr(transfer, "replacing", 0)
        per_call = max(1, self.client.batch_size)
        for start in range(0, len(keys), per_call):
            if not job.may_publish():  # given up at its deadline: no more calls into the pool
                result.fail(transfer.block_ids[start:], Outcome.TIMEOUT)
                break
            part_keys = keys[start : start + per_call]
            if start < replacing:
                self.client.remove(part_keys[: replacing - start])
            part = slot.part(start * size, len(part_keys) * size)
            self._put_staged(
                result, job, part, part_keys, transfer.block_ids[start : start + per_call], copier
            )
        return result

    def _save_group(
        self, transfer: GroupTransfer, job: Job, last: bool, staged: dict[int, StagedGroup] | None = None
    ) -> GroupResult:
        """Copy the blocks into staging, then reserve, write and publish their objects (staged
        already, with the request's other groups, when ``staged`` has this group)."""
        if staged is not None and transfer.group_id in staged:
            return self._put_together(transfer, job, staged[transfer.group_id])
        result = GroupResult()
        copier = self.copiers[transfer.group_id]
        if not transfer.block_ids or copier is None or not self.writes[transfer.group_id]:
            return result  # nothing of this group here, or another rank of its shard saves it
        slot = self._staging_for(transfer, copier, result)
        if slot is None:
            return result
        size = copier.object_bytes
        per_call = max(1, min(self.client.batch_size, slot.nbytes // size))
        keys = self._keys(transfer)
        replacing = getattr(transfer, "replacing", 0)
        for start in range(0, len(keys), per_call):
            part_keys = keys[start : start + per_call]
            part_blocks = transfer.block_ids[start : start + per_call]
            if not job.begin_touch():
                result.fail(transfer.block_ids[start:], Outcome.TIMEOUT)
                break
            try:
                if copier.use_memmove:
                    checks = copier.stage(slot, part_blocks)
                else:  # queued on this thread's stream; released before the device ran it
                    copier.from_blocks(slot, part_blocks, synchronize=False)
                    self._note_blocks_read(job)
            finally:
                job.end_touch(last=last and start + per_call >= len(keys))
            if not copier.use_memmove:  # taken where the bytes are; waits for this thread's stream
                checks = slot.payload_word_sums(range(len(part_blocks)), size)
            identities = [self._identity(transfer, start + i, copier) for i in range(len(part_keys))]
            headers = [pack_header(h, check, copier.checksum) for h, check in zip(identities, checks)]
            slot.write_headers(headers, size)
            if start < replacing:
                self.client.remove(part_keys[: replacing - start])
            self._put_staged(result, job, slot, part_keys, part_blocks, copier)
        return result

    def _note_blocks_read(self, job: Job) -> None:
        """Keep a marker after ``job``'s queued reads of its blocks, for the save barrier."""
        marker = self.order.blocks_read()
        if marker is not None:
            with self._lock:
                self._blocks_read[job] = marker

    def _put_staged(
        self,
        result: GroupResult,
        job: Job,
        slot: StagingSlot,
        keys: Sequence[str],
        blocks: Sequence[int],
        copier: GroupCopier,
    ) -> None:
        """Reserve, write and publish staged objects ``0..len(keys)-1``; revoke them once abandoned."""
        size = copier.object_bytes
        codes = self.client.reserve(keys, [size] * len(keys))
        reserved = []
        for i, code in enumerate(codes):
            if code == 0:
                reserved.append(i)
            elif code == CODE_OBJECT_EXISTS:
                # Mooncake keeps the first value of a key; the same block is stored, and no
                # byte of it moved.
                result.blocks += 1
                result.held_bytes += copier.payload_bytes
            else:
                result.fail([blocks[i]], classify(code))
        if not reserved:
            return
        written_codes = self.client.write(
            [keys[i] for i in reserved],
            [[slot.ptr + i * size] for i in reserved],
            [[size]] * len(reserved),
            [[0]] * len(reserved),
        )
        written = [i for i, code in zip(reserved, written_codes) if code == size]
        unwritten = [i for i, code in zip(reserved, written_codes) if code != size]
        for i, code in zip(reserved, written_codes):
            if code != size:
                result.fail([blocks[i]], classify(code) if code < 0 else Outcome.TRANSFER_FAILED)
        if written and not job.may_publish():
            # Given up at its deadline: what it wrote is never made visible.
            result.fail([blocks[i] for i in written], Outcome.TIMEOUT)
            unwritten, written = unwritten + written, []
        if unwritten:
            self.client.revoke([keys[i] for i in unwritten])
        if written:
            for i, code in zip(written, self.client.publish([keys[i] for i in written])):
                if code == 0:
                    result.blocks += 1
                    result.bytes += copier.payload_bytes
                else:
                    result.fail([blocks[i]], classify(code))
        job.progress()

    # --- shared ------------------------------------------------------------------------
    def _saves_group(self, group_id: int) -> bool:
        """Whether this rank saves ``group_id``'s blocks: it holds the group and writes its shard."""
        return self.copiers[group_id] is not None and self.writes[group_id]

    def _keys(self, transfer: GroupTransfer) -> list[str]:
        shard = self.shards[transfer.group_id]
        return [self.keyspace.key(transfer.group_id, shard, self.pp_rank, d) for d in transfer.digests]

    def _identity(self, transfer: GroupTransfer, index: int, copier: GroupCopier) -> ObjectIdentity:
        return ObjectIdentity(
            fingerprint=self.keyspace.fingerprint,
            digest=transfer.digests[index],
            group=transfer.group_id,
            tp_rank=self.shards[transfer.group_id],
            pp_rank=self.pp_rank,
            payload_bytes=copier.payload_bytes,
        )

    def _traced_group(
        self,
        op: str,
        transfer: GroupTransfer,
        job: Job,
        last: bool = False,
        staged: dict[int, StagedGroup] | None = None,
    ) -> GroupResult:
        """One group's transfer as a child span of the request's."""
        with tracing.span(
            f"kvpool.{op}.group",
            group=transfer.group_id,
            group_kind=self.stats.group_kinds[transfer.group_id] if self.stats.group_kinds else None,
            masked_blocks=transfer.masked,
        ) as span:
            started = time.perf_counter()
            try:
                if op == "load":
                    result = self._load_group(transfer, job)
                else:
                    result = self._save_group(transfer, job, last, staged)
            except Exception:  # never let a transfer bug reach the forward pass
                logger.exception("KVPoolConnector %s failed for group %d", op, transfer.group_id)
                result = GroupResult(attempted=True)
                result.fail(transfer.block_ids, Outcome.OTHER)
            early = staged.get(transfer.group_id) if staged is not None else None
            result.seconds = time.perf_counter() - started + (early.seconds if early else 0.0)
            tracing.set_attributes(
                span, blocks=result.blocks, bytes=result.bytes, direct_blocks=result.direct_blocks
            )
            tracing.mark_failed(span, result.failures)
        return result

    def _record(
        self,
        op: str,
        req_id: str,
        transfers: list[GroupTransfer],
        results: list[GroupResult],
        started: float,
        load_errors: int = 0,
        recomputed: bool = False,
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
                direct_blocks=sum(r.direct_blocks for r in results),
                held_bytes=tuple(r.held_bytes for r in results),
                load_error_blocks=load_errors,
                recomputed=recomputed,
                req_id=req_id,
            )
        )

    # --- teardown -------------------------------------------------------------------
    def shutdown(self) -> bool:
        """Drain saves for up to ``shutdown_timeout_s``, then abandon whatever is left; a save
        still queued then never starts, and is recorded failed (``timeout``) on its keys.

        True when no call is left in flight; False when one is still stuck in
        Mooncake (its staging buffer stays; the client closes after it returns).
        """
        if self._closed:
            return not self.jobs.stalled
        self._closed = True
        deadline = time.monotonic() + self.deadlines.shutdown_s
        for job in self.jobs.live():
            if job.kind == "save":
                job.wait(deadline=deadline)
        abandoned = [job for job in self.jobs.live() if job.abandon()]
        if abandoned:
            logger.warning(
                "KVPoolConnector shutdown: %d transfer(s) still running after %.1f s abandoned; "
                "they publish nothing",
                len(abandoned),
                self.deadlines.shutdown_s,
            )
        with self._lock:
            submitted = dict(self._futures)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fetchers.shutdown(wait=False)
        cancelled = [job for job, future in submitted.items() if future.cancelled()]
        for job in cancelled:  # never started: nothing of it is in the pool
            with self._lock:
                save = self._queued_saves.pop(job, None)
            if save is not None:  # reported like any save given up at its deadline
                results = [self._not_saved(g, _timed_out) for g in save.groups]
                self._record("save", save.req_id, save.groups, results, time.perf_counter())
            job.returned()
            self._forget(job)
        for job in self.jobs.live():
            job.wait(deadline=time.monotonic() + 0.05)
        if any(job.in_flight for job in self.jobs.live()):
            return False  # a call stuck in Mooncake may still use the registered memory
        with self._lock:
            # A buffer given up on stays registered: Mooncake's transport may still write it.
            resting = {id(slot) for _, slot in self._retired}
            spans = self._kv_spans + [(s.ptr, s.nbytes) for s in self._slots if id(s) not in resting]
            self._kv_spans = []
        for ptr, size in spans:
            self.client.unregister(ptr, size)
        return True


def _failed(transfer: GroupTransfer, outcome: Outcome) -> GroupResult:
    """A group whose transfer never started, for ``outcome``: its blocks failed, and no
    latency or size (not attempted)."""
    result = GroupResult()
    if transfer.block_ids:
        result.fail(list(transfer.block_ids), outcome)
    return result


def _timed_out(
    transfer: GroupTransfer, skip: set[tuple[int, int]] | None = None, seconds: float | None = None
) -> GroupResult:
    """A group whose transfer was given up at its deadline (``skip``: (group, block) already
    loaded) after ``seconds``; None: before it started (not attempted: no latency, no size)."""
    result = GroupResult(attempted=bool(transfer.block_ids) and seconds is not None, seconds=seconds or 0.0)
    missed = [b for b in transfer.block_ids if not skip or (transfer.group_id, b) not in skip]
    if missed:
        result.fail(missed, Outcome.TIMEOUT)
    result.blocks = len(transfer.block_ids) - len(missed)
    return result


def _subset(transfer: GroupTransfer, indices: Sequence[int]) -> GroupTransfer:
    """The blocks of ``transfer`` at ``indices`` (a load's part: its digests and block ids)."""
    return GroupTransfer(
        group_id=transfer.group_id,
        digests=[transfer.digests[i] for i in indices],
        block_ids=[transfer.block_ids[i] for i in indices],
    )
