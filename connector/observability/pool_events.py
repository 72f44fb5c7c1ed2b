"""KV-cache events for routers: what this engine stores into and drops from the pool.

Cache-aware routers (llm-d, vLLM production-stack) follow vLLM's KV events. When
vLLM's ``kv_events_config`` enables them, the connector adds its own through
vLLM's plumbing: workers report the pool keys they published or removed
(:class:`PoolKeyReports`, returned by ``get_kv_connector_kv_cache_events``,
merged across workers by vLLM), the scheduler side turns them into
``BlockStored`` / ``BlockRemoved`` events (``take_events``), and vLLM's
publisher sends them with its own (ZMQ).

A block counts as stored once every key of it has been published (one per
pipeline rank and tensor shard: :mod:`kvpool.connector.contract.shards`): only
then can a lookup hit it. A key of it removed (a corrupt object, a block
saved again) removes the block. A reset of the pool's layout is
``AllBlocksCleared``. Events carry what vLLM's own events carry: the block hash,
its parent, the block's token ids and the group; ``medium`` is ``CPU`` (the
store processes' memory) and ``locality`` ``REMOTE``. Evictions by the master
are not seen by the engine and produce no event. Events of saves that finish
after the engine's last step go out with its next step.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from kvpool.connector.contract.keys import hash_digest
from kvpool.connector.metadata import PoolConnectorMetadata
from kvpool.connector.pool_client import CODE_OBJECT_EXISTS

POOL_MEDIUM = MEDIUM_CPU
POOL_LOCALITY = "REMOTE"
STORED, REMOVED = "stored", "removed"
#: Blocks planned but not yet stored by every rank, and blocks announced as stored, kept
#: at most (the oldest go first): bounds memory when reports never come.
MAX_TRACKED_BLOCKS = 1 << 17
#: Token ids the events of planned blocks hold at most, all together (the oldest go first): a
#: block's event carries its token ids, and a save that fails reports nothing, so its event
#: waits until pushed out. Without it the bound above grows with the block size (a hybrid
#: model's blocks of thousands of tokens: gigabytes). About 40 MiB of Python ints.
MAX_PENDING_TOKENS = 1 << 20

Entry = tuple[str, int, str, int]  # (STORED | REMOVED, group, digest, rank)


def events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV-cache events (``kv_events_config.enable_kv_cache_events``)."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and config.enable_kv_cache_events)


class PoolKeyReports(KVConnectorKVEvents):
    """What workers did to pool keys: ``(op, group, digest, rank)`` entries, worker to scheduler."""

    def __init__(self, entries: Iterable[Entry] = (), num_workers: int = 1):
        self._entries: list[Entry] = list(entries)
        self._num_workers = num_workers

    def add_events(self, events: list[Any]) -> None:
        self._entries.extend(events)

    def aggregate(self) -> PoolKeyReports:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._num_workers += count

    def get_all_events(self) -> list[Any]:
        return list(self._entries)

    def get_number_of_workers(self) -> int:
        return self._num_workers

    def clear_events(self) -> None:
        self._entries.clear()


def key_block(key: str) -> tuple[int, str] | None:
    """(group, digest) of a pool key (``.../g<group>/<digest>``); None for another shape."""
    parts = key.rsplit("/", 2)
    if len(parts) != 3 or not parts[1].startswith("g") or not parts[1][1:].isdigit():
        return None
    return int(parts[1][1:]), parts[2]


class WorkerReports:
    """A worker's pool keys published and removed since the last step (thread-safe)."""

    def __init__(self, rank: int):
        self.rank = rank
        self._lock = threading.Lock()
        self._entries: list[Entry] = []

    def note(self, op: str, keys: Sequence[str], codes: Sequence[int], done: Callable[[int], bool]) -> None:
        entries = []
        for key, code in zip(keys, codes):
            block = key_block(key) if done(code) else None
            if block is not None:
                entries.append((op, block[0], block[1], self.rank))
        if entries:
            with self._lock:
                self._entries.extend(entries)

    def take(self) -> PoolKeyReports | None:
        with self._lock:
            entries, self._entries = self._entries, []
        return PoolKeyReports(entries) if entries else None


class ObservedClient:
    """A worker's pool client that reports the keys it published (now in the pool) and removed.

    Everything else goes to the client unchanged.
    """

    def __init__(self, client: Any, reports: WorkerReports):
        self._client = client
        self._reports = reports

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def reserve(self, keys: Sequence[str], sizes: Sequence[int]) -> list[int]:
        codes = self._client.reserve(keys, sizes)
        # The key already holds the block (Mooncake keeps the first value): it is stored.
        self._reports.note(STORED, keys, codes, lambda code: code == CODE_OBJECT_EXISTS)
        return codes

    def publish(self, keys: Sequence[str]) -> list[int]:
        codes = self._client.publish(keys)
        self._reports.note(STORED, keys, codes, lambda code: code == 0)
        return codes

    def remove(self, keys: Sequence[str]) -> list[int]:
        codes = self._client.remove(keys)
        self._reports.note(REMOVED, keys, codes, lambda code: code == 0)
        return codes


@dataclass
class _Pending:
    """A planned save's event, waiting for every rank to store its key."""

    event: BlockStored
    ranks: set[int] = field(default_factory=set)


class SchedulerEvents:
    """The scheduler side: save plans and worker reports in, vLLM KV-cache events out."""

    def __init__(self, kv_cache_config: Any, world_size: int | Sequence[int]):
        """``world_size``: the keys of one block (per group, or one count for every group)."""
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

        specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        self.kinds = [get_kv_cache_spec_kind(s).value for s in specs]
        self.windows = [get_kv_cache_spec_sliding_window(s) for s in specs]
        self.world_size = world_size
        self._keys_per_block = [world_size] * len(specs) if isinstance(world_size, int) else list(world_size)
        self._requests: dict[str, Any] = {}
        self._pending: OrderedDict[tuple[int, str], _Pending] = OrderedDict()
        self._pending_tokens = 0  # the token ids their events hold
        self._announced: OrderedDict[tuple[int, str], Any] = OrderedDict()
        self._out: list[KVCacheEvent] = []

    # --- requests ---------------------------------------------------------------
    def track(self, request: Any) -> None:
        self._requests[request.request_id] = request

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    # --- plans and reports ------------------------------------------------------------
    def on_saves_planned(
        self,
        meta: PoolConnectorMetadata,
        block_ids_of: Callable[[str], Sequence[list[int]]],
        coordinator: Any,
    ) -> None:
        """Remember the event of every block this step's saves will store."""
        for save in meta.saves:
            request = self._requests.get(save.req_id)
            if request is None or coordinator is None:
                continue
            all_ids = block_ids_of(save.req_id)
            for transfer in save.groups:
                if not transfer.block_ids:
                    continue
                gid = transfer.group_id
                index_of = {block: i for i, block in enumerate(all_ids[gid])}
                hashes = coordinator.group_block_hashes(gid, request.block_hashes)
                block_size = coordinator.groups[gid].block_size
                for digest, block in zip(transfer.digests, transfer.block_ids):
                    index = index_of.get(block)
                    if index is None or index >= len(hashes) or hash_digest(bytes(hashes[index])) != digest:
                        continue  # not this request's block as planned: no event
                    parent = hashes[index - 1] if index > 0 else None
                    event = self._stored_event(request, gid, index, block_size, hashes[index], parent)
                    self._hold((gid, digest), _Pending(event))

    def _stored_event(
        self, request: Any, gid: int, index: int, block_size: int, block_hash: Any, parent: Any
    ) -> BlockStored:
        start, end = index * block_size, (index + 1) * block_size
        extra, _ = generate_block_hash_extra_keys(request, start, end, 0)
        lora = request.lora_request
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(block_hash)],
            parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
            token_ids=list(request.all_token_ids[start:end]),
            block_size=block_size,
            lora_id=lora.adapter_id if lora else None,
            medium=POOL_MEDIUM,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys([extra]),
            group_idx=gid,
            kv_cache_spec_kind=self.kinds[gid],
            kv_cache_spec_sliding_window=self.windows[gid],
            locality=POOL_LOCALITY,
            session_id=getattr(request, "session_id", None),
        )

    def on_reports(self, reports: Any) -> None:
        """Workers' key reports (vLLM's ``kv_cache_events`` of the step's connector output)."""
        if not isinstance(reports, PoolKeyReports):
            return
        for op, gid, digest, rank in reports.get_all_events():
            block = (gid, digest)
            if op == REMOVED:
                announced = self._announced.pop(block, None)
                if announced is not None:
                    self._out.append(
                        BlockRemoved(
                            block_hashes=[announced],
                            medium=POOL_MEDIUM,
                            group_idx=gid,
                            locality=POOL_LOCALITY,
                        )
                    )
                continue
            pending = self._pending.get(block)
            if pending is None:
                continue
            pending.ranks.add(rank)
            if len(pending.ranks) >= self._keys_per_block[gid]:
                del self._pending[block]
                self._pending_tokens -= len(pending.event.token_ids)
                self._out.append(pending.event)
                self._remember(self._announced, block, pending.event.block_hashes[0])

    def on_reset(self) -> None:
        """The layout's keys were cleared from the pool: everything announced is gone."""
        self._pending.clear()
        self._pending_tokens = 0
        self._announced.clear()
        self._out.append(AllBlocksCleared())

    def take_events(self) -> list[KVCacheEvent]:
        out, self._out = self._out, []
        return out

    def _hold(self, block: tuple[int, str], pending: _Pending) -> None:
        """Keep ``pending`` until every rank stored ``block``, within both bounds (oldest out first)."""
        replaced = self._pending.pop(block, None)
        if replaced is not None:
            self._pending_tokens -= len(replaced.event.token_ids)
        self._pending[block] = pending
        self._pending_tokens += len(pending.event.token_ids)
        while len(self._pending) > MAX_TRACKED_BLOCKS or self._pending_tokens > MAX_PENDING_TOKENS:
            _, oldest = self._pending.popitem(last=False)
            self._pending_tokens -= len(oldest.event.token_ids)

    @staticmethod
    def _remember(table: OrderedDict[tuple[int, str], Any], block: tuple[int, str], value: Any) -> None:
        table[block] = value
        table.move_to_end(block)
        while len(table) > MAX_TRACKED_BLOCKS:
            table.popitem(last=False)


class PoolEvents:
    """The connector's KV-event half for one role; does nothing when vLLM's events are off."""

    def __init__(
        self, enabled: bool, *, scheduler: SchedulerEvents | None = None, worker: WorkerReports | None = None
    ):
        self.enabled = enabled
        self.scheduler = scheduler if enabled else None
        self.worker = worker if enabled else None

    @classmethod
    def for_scheduler(
        cls, vllm_config: Any, kv_cache_config: Any, world_size: int | Sequence[int]
    ) -> PoolEvents:
        enabled = events_enabled(vllm_config)
        return cls(enabled, scheduler=SchedulerEvents(kv_cache_config, world_size) if enabled else None)

    @classmethod
    def for_worker(cls, vllm_config: Any, rank: int) -> PoolEvents:
        enabled = events_enabled(vllm_config)
        return cls(enabled, worker=WorkerReports(rank) if enabled else None)

    # worker side
    def observe(self, client: Any) -> Any:
        """The worker's client, observed when events are on."""
        return client if self.worker is None else ObservedClient(client, self.worker)

    def worker_reports(self) -> PoolKeyReports | None:
        return None if self.worker is None else self.worker.take()

    # scheduler side
    def track(self, request: Any) -> None:
        if self.scheduler is not None:
            self.scheduler.track(request)

    def forget(self, req_id: str) -> None:
        if self.scheduler is not None:
            self.scheduler.forget(req_id)

    def on_saves_planned(self, meta: Any, block_ids_of: Any, coordinator: Any) -> None:
        if self.scheduler is not None and isinstance(meta, PoolConnectorMetadata) and meta.saves:
            self.scheduler.on_saves_planned(meta, block_ids_of, coordinator)

    def on_reports(self, reports: Any) -> None:
        if self.scheduler is not None and reports is not None:
            self.scheduler.on_reports(reports)

    def on_reset(self) -> None:
        if self.scheduler is not None:
            self.scheduler.on_reset()

    def take_events(self) -> list[KVCacheEvent]:
        return [] if self.scheduler is None else self.scheduler.take_events()
