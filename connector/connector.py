"""``KVPoolConnector``: vLLM's KV connector API over a shared Mooncake pool.

Load it with::

    {"kv_connector": "KVPoolConnector",
     "kv_connector_module_path": "kvpool.connector",
     "kv_role": "kv_both",
     "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"master_server_address": "127.0.0.1:50051"}}
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpool.connector.contract.identity import refuse_weak_block_hash
from kvpool.connector.contract.keys import KeySpace
from kvpool.connector.contract.layout import check_or_raise
from kvpool.connector.contract.layout import fingerprint as layout_fingerprint
from kvpool.connector.contract.metric_names import LOAD
from kvpool.connector.contract.object_header import payload_crc_in_hardware
from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.contract.shards import group_shards
from kvpool.connector.integrity.device_order import TransferOrder
from kvpool.connector.integrity.layout_verdict import OutOfPool, add_counters, verify_declared_layout
from kvpool.connector.metadata import PoolConnectorMetadata, runs_no_forward
from kvpool.connector.observability import tracing
from kvpool.connector.observability.logs import get_logger
from kvpool.connector.observability.pool_events import PoolEvents
from kvpool.connector.observability.records import StatsCollector, TransferRecord, failed_lookup
from kvpool.connector.observability.vllm_metrics import (
    PoolConnectorStats,
    PoolPromMetrics,
    TransferSizes,
    fingerprint_info_key,
    in_pool_gauge,
    merge_data,
    records_to_data,
    zero_series,
)
from kvpool.connector.pool_client import acquire_client, release_client
from kvpool.connector.scheduler.pool_reset import LayoutReset
from kvpool.connector.scheduler.side import SchedulerSide
from kvpool.connector.vllm_layout import key_fingerprint_inputs_from_vllm, layout_from_vllm
from kvpool.connector.worker.side import Deadlines, WorkerSide, read_ahead_bytes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)


def saves_read_blocks_within_the_step(vllm_config: VllmConfig) -> bool:
    """Whether a step's saves must have read their blocks before the step ends (else before
    the next forward).

    The V2 model runner zeroes and copies blocks before ``handle_preemptions`` (the V1
    runner calls it first). With sleep mode vLLM may release the KV cache's memory after
    any step, with no later step, so a save still queued would read memory that is gone
    (or, after a wake-up, blocks that hold something else).
    """
    try:
        v2_runner = bool(vllm_config.use_v2_model_runner)
    except Exception:  # an unknown runner: be safe
        return True
    return v2_runner or bool(getattr(vllm_config.model_config, "enable_sleep_mode", False))


def recompute_failed_loads(transfer: Any) -> None:
    """A pool is a cache: a block it fails to deliver is recomputed, never a failed request.

    vLLM's default ``kv_load_failure_policy`` ("fail") would end the request with an
    error; the scheduler reads the policy after it has created this connector, so the
    connector sets "recompute" (with a warning naming the field) before it is read.
    """
    policy = getattr(transfer, "kv_load_failure_policy", "recompute")
    if policy != "recompute":
        logger.warning(
            "kv_load_failure_policy=%r: KVPoolConnector is a cache, a block it fails to "
            "deliver is a miss; set to 'recompute' (its requests recompute instead of failing)",
            policy,
        )
        transfer.kv_load_failure_policy = "recompute"


def warn_if_workers_stop_first(vllm_config: Any, shutdown_timeout_s: float) -> bool:
    """Warn when vLLM stops worker processes before the saves in flight at shutdown may drain.

    vLLM's multiprocess executor (tensor or pipeline parallel) terminates its workers
    ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` into shutdown; a save still running then
    publishes nothing (a later miss). True when it warned.
    """
    import vllm.envs as envs

    backend = getattr(vllm_config.parallel_config, "distributed_executor_backend", None)
    grace = envs.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS
    if backend != "mp" or grace >= shutdown_timeout_s:
        return False
    logger.warning(
        "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=%d is below shutdown_timeout_s=%.1f: vLLM stops its "
        "workers before their last saves may drain (those blocks miss later); raise it",
        grace,
        shutdown_timeout_s,
    )
    return True


def warn_if_sleep_mode_on_an_accelerator(vllm_config: Any, kv_caches: Mapping[str, Any]) -> bool:
    """Warn that sleep mode and the pool do not go together on an accelerator (True when it
    warned).

    vLLM registers the KV caches (and so allocates the staging buffers) inside its CuMem
    pools, and a sleep releases that memory with no connector hook before it: a transfer
    still in flight then reads or writes released memory, and registrations for RDMA point
    at pages the wake-up no longer maps. Headers and checksums keep wrong KV out, but the
    engine may fail.
    """
    if not getattr(vllm_config.model_config, "enable_sleep_mode", False):
        return False
    devices = {str(getattr(t, "device", "cpu")).split(":")[0] for t in kv_caches.values()}
    if devices <= {"cpu"}:
        return False
    logger.warning(
        "KVPoolConnector with enable_sleep_mode on %s: a transfer in flight when the engine "
        "sleeps touches released memory, and RDMA registrations do not survive a sleep "
        "(docs/architecture.md, sleep mode); run the pool without sleep mode here",
        ", ".join(sorted(devices - {"cpu"})),
    )
    return True


def record_recovery(stats: StatsCollector, failed_requests: int, failed_blocks: int) -> None:
    """Count what vLLM recomputes after failed loads: requests sent back whole (hybrid
    layouts) and blocks handed back (single-group layouts)."""
    if not failed_requests and not failed_blocks:
        return
    groups = stats.group_kinds
    zeros = tuple(0 for _ in groups)
    for index in range(max(failed_requests, 1)):
        stats.record_transfer(
            TransferRecord(
                operation=LOAD,
                group_kinds=groups,
                blocks=zeros,
                masked=zeros,
                bytes=zeros,
                failures={},
                seconds=0.0,
                group_failures=tuple({} for _ in groups),
                group_seconds=tuple(0.0 for _ in groups),
                group_attempted=tuple(False for _ in groups),
                load_error_blocks=failed_blocks if index == 0 else 0,
                recomputed=index < failed_requests,
            )
        )


def forward_raised() -> bool:
    """Whether an exception is passing through the caller: vLLM calls ``wait_for_save`` in the
    ``finally`` around the forward (``_get_kv_connector_output``), so one there means the
    forward raised and the step's blocks may hold anything. (Called inside an unrelated
    ``except`` further up the stack, it answers True too: a lost save, never a wrong one.)"""
    return sys.exc_info()[1] is not None


def step_block_ids(
    scheduler_output: Any, block_ids_of: Callable[[str], Sequence[list[int]]]
) -> Callable[[str], Sequence[list[int]]]:
    """``block_ids_of`` for this step, answered from the step's output for the requests it
    schedules anew: vLLM put each one's whole block table there this step (building it
    again per request costs admission a few µs each); the others ask ``block_ids_of``."""
    new = {r.req_id: r.block_ids for r in getattr(scheduler_output, "scheduled_new_reqs", ())}
    if not new:
        return block_ids_of

    def of(req_id: str) -> Sequence[list[int]]:
        ids = new.get(req_id)
        return block_ids_of(req_id) if ids is None else ids

    return of


def _ranks() -> tuple[int, int]:
    """(tp_rank, pp_rank) of this worker; (0, 0) outside a distributed setup."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return get_tp_group().rank_in_group, get_pp_group().rank_in_group
    except (AssertionError, AttributeError, ImportError):
        return 0, 0


class KVPoolConnector(KVConnectorBase_V1, SupportsHMA):
    """Store and load hybrid-model KV blocks in a shared Mooncake pool."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = ConnectorSettings.from_sources(transfer.kv_connector_extra_config)
        self.layout = layout_from_vllm(vllm_config, kv_cache_config, self.settings.model_id)
        check_or_raise(self.layout)
        # A declared layout other than the one vLLM built keeps this engine out of the pool.
        self.layout_verdict = verify_declared_layout(
            self.settings, self.layout, scheduler=role == KVConnectorRole.SCHEDULER
        )
        in_pool = self.layout_verdict.in_pool
        if role == KVConnectorRole.SCHEDULER:
            recompute_failed_loads(transfer)
            warn_if_workers_stop_first(vllm_config, self.settings.shutdown_timeout_s)
        tracing.configure_from_env()
        self._fingerprint_inputs = key_fingerprint_inputs_from_vllm(vllm_config, kv_cache_config, self.layout)
        refuse_weak_block_hash(
            self._fingerprint_inputs["block_hash_algorithm"], self.settings.allow_non_cryptographic_block_hash
        )
        # The scheduler side exports them once, as vllm:kvpool_key_fingerprint_info.
        self._fingerprint_exported = role != KVConnectorRole.SCHEDULER
        self._in_pool_exported: bool | None = None  # the scheduler's vllm:kvpool_in_pool, last sent
        # The scheduler's first stats carry its counters known up front at 0 (its groups' too).
        self._zeros_exported = role != KVConnectorRole.SCHEDULER
        self.keyspace = KeySpace(self.settings.cache_prefix, self._fingerprint_inputs["fingerprint"])
        self.stats = StatsCollector(group_kinds=tuple(g.kind.value for g in self.layout.groups))
        # Per group: the objects of one block per pipeline stage (fewer than the ranks when
        # ranks hold copies of the KV: one of them saves, all read).
        shards = group_shards(self.layout)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        # The scheduler joins every rank's bytes of a transfer into one observation.
        self._transfer_sizes = TransferSizes(self.layout.tp_size * self.layout.pp_size)
        self._events = PoolEvents(False)
        self._reset: LayoutReset | None = None
        if role == KVConnectorRole.SCHEDULER:
            # The scheduler only looks keys up: it contributes no memory.
            if in_pool:
                self._client = acquire_client(self.settings, global_segment_size=0, attach_later=True)
            else:
                self._client = OutOfPool()
            self._scheduler = SchedulerSide(
                client=self._client,
                keyspace=self.keyspace,
                tp_size=self.layout.tp_size,
                pp_size=self.layout.pp_size,
                group_shards=shards,
                save_decode_cache=self.settings.save_decode_cache,
                can_load=transfer.is_kv_consumer and in_pool,
                can_save=transfer.is_kv_producer and in_pool,
                stats=self.stats,
                lookup_timeout_s=self.settings.lookup_timeout_s,
                lookup_budget_s=self.settings.lookup_budget_ms / 1000,
                idle_step_wait_s=self.settings.idle_step_wait_s,
                load_policy=self.settings.load_policy,
                load_margin=self.settings.load_margin,
                load_decision_min_samples=self.settings.load_decision_min_samples,
                transport=self.settings.protocol,
            )
            keys_per_block = tuple(self.layout.pp_size * n for n in shards)
            self._events = PoolEvents.for_scheduler(vllm_config, kv_cache_config, keys_per_block)
            self._reset = LayoutReset(self._client, self.keyspace) if in_pool else None
        else:
            self._client = acquire_client(self.settings, attach_later=True) if in_pool else OutOfPool()
            if in_pool and not payload_crc_in_hardware():
                logger.warning(
                    "KVPoolConnector: google-crc32c runs in pure Python here; every transfer checks "
                    "each block's CRC-32C, so loads and saves will be far slower"
                )
            tp_rank, pp_rank = _ranks()
            # Only rank 0 counts a transfer's blocks and events; every rank its bytes.
            self.stats.rank = pp_rank * self.layout.tp_size + tp_rank
            self._events = PoolEvents.for_worker(vllm_config, self.stats.rank)
            self._worker = WorkerSide(
                client=self._events.observe(self._client),
                keyspace=self.keyspace,
                tp_rank=tp_rank,
                pp_rank=pp_rank,
                group_layers=[list(g.layer_names) for g in kv_cache_config.kv_cache_groups],
                tp_size=self.layout.tp_size,
                group_shards=shards,
                num_blocks=kv_cache_config.num_blocks,
                stats=self.stats,
                deadlines=Deadlines.of(self.settings),
                staging_bytes=self.settings.staging_buffer_size,
                load_batch_bytes=read_ahead_bytes(
                    self.settings.global_segment_size, self.settings.load_batch_bytes
                ),
                transfer_threads=self.settings.transfer_threads,
                idle_step_wait_s=self.settings.idle_step_wait_s,
                direct_local_loads=self.settings.direct_local_loads and self.settings.global_segment_size > 0,
                order=TransferOrder(drain_saves=saves_read_blocks_within_the_step(vllm_config)),
                failures_by_request=not self.layout.recovers_failed_loads_by_block,
            )
        # layout= is the layout's fingerprint (the operator's layoutFingerprint of a declared one);
        # keys= the one in this engine's pool keys (the layout and what else makes KV the same).
        logger.info(
            "KVPoolConnector %s: master=%s layout=%s keys=%s groups=%s",
            role.name,
            self.settings.master_server_address,
            layout_fingerprint(self.layout),
            self.keyspace.fingerprint,
            [g.kind.value for g in self.layout.groups],
        )

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache: a dropped save is a future miss, never a lost hand-off.
        return False

    # ==== scheduler side ====================================================
    def _sched(self) -> SchedulerSide:
        assert self._scheduler is not None, "scheduler-side call on a worker connector"
        return self._scheduler

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched().bind(kv_cache_manager.coordinator)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        try:
            return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception:  # a lookup must never stop a request: it computes instead
            logger.exception("KVPoolConnector lookup failed; computing the request without the pool")
            self.stats.record_lookup(failed_lookup(self.stats.group_kinds, request, num_computed_tokens))
            return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks.get_block_ids, num_external_tokens)
        self._events.track(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        manager = self._kv_cache_manager
        assert manager is not None, "KVPoolConnector needs bind_kv_cache_manager"
        block_ids_of = step_block_ids(scheduler_output, manager.get_block_ids)
        meta = self._sched().build_connector_meta(scheduler_output, block_ids_of)
        self._events.on_saves_planned(meta, block_ids_of, self._sched().coordinator)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        manager = self._kv_cache_manager
        failed_requests = set(getattr(connector_output, "failed_recving", None) or ())
        failed_blocks = set(connector_output.invalid_block_ids or ())
        newly_failed_blocks = self._sched().on_worker_output(
            set(connector_output.finished_recving or ()),
            failed_requests,
            failed_blocks,
            None if manager is None else manager.get_block_ids,
        )
        # What vLLM recomputes, over every rank's failures: counted here, once.
        record_recovery(self.stats, len(failed_requests), newly_failed_blocks)
        # Each transfer's bytes over every rank: observed once the last rank's share is in.
        self._transfer_sizes.add(connector_output.kv_connector_stats)
        # The step's wall time and the workers' transfers: the load decision's rates.
        self._sched().on_step_output(connector_output.kv_connector_stats)
        self._events.on_reports(getattr(connector_output, "kv_cache_events", None))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._events.forget(request.request_id)
        return self._sched().request_finished(request.request_id), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._events.forget(request.request_id)
        return self._sched().request_finished(request.request_id), None

    def take_events(self) -> list[Any]:
        # This engine's pool stores and removals, as vLLM KV-cache events (see pool_events).
        return self._events.take_events()

    def reset_cache(self) -> bool | None:
        # vLLM's reset with reset_connector: this layout's keys leave the pool (see pool_reset).
        cleared = True if self._reset is None else self._reset.reset()
        if cleared:
            self._events.on_reset()
        return cleared

    # ==== stats (both sides) ================================================
    def get_kv_connector_stats(self) -> PoolConnectorStats | None:
        lookups, transfers = self.stats.drain()
        layout_counters = self.layout_verdict.take_counters()
        gauges: dict[str, float] = {}
        if not self._fingerprint_exported:
            self._fingerprint_exported = True
            gauges = {fingerprint_info_key(self._fingerprint_inputs): 1.0}
        zeros: dict[str, float] = {}
        if not self._zeros_exported:
            self._zeros_exported = True
            zeros = dict.fromkeys(zero_series([g.kind.value for g in self.layout.groups]), 0.0)
        decisions = None
        sizes: dict[str, list[float]] = {}
        if self._scheduler is not None:
            sizes = self._transfer_sizes.take()
            in_pool = self.layout_verdict.in_pool and bool(self._client.attached)
            if in_pool != self._in_pool_exported:
                self._in_pool_exported = in_pool
                gauges.update(in_pool_gauge(in_pool))
            # vLLM asks once per step output (scheduler side): the step is done.
            self._scheduler.on_step_done()
            decisions = self._scheduler.take_decision_data()
        if not any((lookups, transfers, layout_counters, gauges, decisions, zeros, sizes)):
            return None
        data = add_counters(records_to_data(lookups, transfers), layout_counters)
        data["counters"] = {**zeros, **data["counters"]}
        data["gauges"] = gauges
        if sizes:
            data = merge_data(data, {"histograms": sizes})
        if decisions:
            data = merge_data(data, decisions)
        return PoolConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PoolConnectorStats:
        return PoolConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PoolPromMetrics:
        return PoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ==== worker side =======================================================
    def _work(self) -> WorkerSide:
        assert self._worker is not None, "worker-side call on a scheduler connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        warn_if_sleep_mode_on_an_accelerator(self._vllm_config, kv_caches)
        self._work().register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # vLLM's first call of a step, before it zeroes new blocks and copies blocks
        # (both may write blocks earlier saves still read): the save barrier.
        self._work().before_forward()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # This step's forward may overwrite blocks earlier saves still read.
        self._work().before_forward()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PoolConnectorMetadata)
        self._work().start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous: a loading request is not in the forward.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # A block is stored whole (all layers of its group) after the forward.
        return

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not (isinstance(meta, PoolConnectorMetadata) and meta.saves):
            return
        if forward_raised():
            self._work().drop_saves(meta)
        else:
            self._work().start_saves(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        recving, failed = self._work().transfer_results(idle=runs_no_forward(self._connector_metadata))
        return KVConnectorTransferResults(finished_recving=recving, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # This older API has no way to say a load failed: answering it would report a failed
        # hybrid load as a success, and not answering would leave its request waiting forever.
        raise NotImplementedError(
            "KVPoolConnector reports finished and failed loads through get_transfer_results "
            "(vLLM >= 0.32); a caller of get_finished cannot learn that a load failed"
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_load_errors()

    def get_kv_connector_kv_cache_events(self) -> Any:
        return self._events.worker_reports()

    def shutdown(self) -> None:
        if self._worker is not None and not self._worker.shutdown():
            # A transfer given up at its deadline is still inside Mooncake (writing only its
            # staging buffer, which stays): the client closes once that call returns.
            logger.warning("KVPoolConnector shutdown: a transfer is still stuck in the pool")
        if self._scheduler is not None:
            self._scheduler.close()
        if self._reset is not None:
            self._reset.close()
        tracing.flush()
        client, self._client = getattr(self, "_client", None), None
        if client is not None:
            release_client(client)
