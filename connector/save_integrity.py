"""What a worker checks so that no save stores wrong KV, apart from moving bytes.

* **Failed loads.** The blocks a step's synchronous loads failed to fill (on any rank:
  :mod:`kvpool.connector.rank_agreement`) are tainted; a save computed from a tainted
  block is dropped and counted as skipped (:mod:`kvpool.connector.taint`).
* **Device order.** Transfer threads touch blocks only after the device work queued
  before them is done (:mod:`kvpool.connector.device_order`): loads after vLLM zeroed
  and copied this step's blocks, saves after the forward that computed them.

Blocks saved again after a failed load carry ``GroupTransfer.replacing``: the save
removes what the pool holds under their keys first, since a put keeps an existing object.

:class:`SaveIntegrity` holds that state for one ``WorkerSide``; the worker calls it
at fixed points of a step (see each method).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpool.connector.device_order import Marker, RecordMarker, forward_marker, wait_for
from kvpool.connector.logs import get_logger
from kvpool.connector.metadata import PoolConnectorMetadata, RequestLoad, RequestSave
from kvpool.connector.rank_agreement import AgreeFailures
from kvpool.connector.taint import Block, BlockTaint

logger = get_logger(__name__)


class SaveIntegrity:
    """One worker's taint, device ordering and rank agreement."""

    def __init__(
        self,
        *,
        record_marker: RecordMarker = forward_marker,
        agree_failures: AgreeFailures | None = None,
        drain_saves: bool = False,
    ):
        self.record_marker = record_marker
        self.agree_failures = agree_failures
        # Whether a step's saves must have read their blocks before the step ends (a model
        # runner that writes blocks before vLLM's first connector call of the next step).
        self.drain_saves = drain_saves
        self.taint = BlockTaint()

    def before_loads(self, meta: PoolConnectorMetadata) -> None:
        """At the start of ``start_loads``: new blocks hold nothing that can be wrong, and
        loads write blocks only after the device work queued before them is done."""
        if self.taint:
            self.taint.forget([(g, b) for g, ids in enumerate(meta.new_blocks) for b in ids])
            self.taint.forget(load_targets(meta.loads))
        if meta.loads:
            wait_for(self.record_marker())

    def after_sync_loads(self, meta: PoolConnectorMetadata, failed_here: Callable[[int], bool]) -> set[int]:
        """Once this step's synchronous loads returned: the block ids that failed on any
        rank (``failed_here``: on this one), now tainted. Every rank calls it in the same
        steps (the metadata decides), so the agreement never waits for a rank that skips it."""
        targets = load_targets([load for load in meta.loads if not load.is_async])
        if not targets:
            return set()
        flags = [int(failed_here(block)) for _, block in targets]
        if self.agree_failures is not None:
            flags = self.agree_failures(flags)
        failed = [target for target, flag in zip(targets, flags, strict=True) if flag]
        self.taint.taint(failed, meta.step)
        return {block for _, block in failed}

    def screen(self, meta: PoolConnectorMetadata) -> tuple[list[RequestSave], list[RequestSave]]:
        """In ``start_saves``: (saves to start, saves computed from wrong blocks)."""
        dropped = self.taint.screen(meta.saves, meta.step)
        if not dropped:
            return list(meta.saves), []
        logger.warning(
            "KVPoolConnector kept %d save(s) out of the pool: computed from blocks whose load failed",
            len(dropped),
        )
        kept = [save for save in meta.saves if all(save is not d for d in dropped)]
        return kept, dropped

    def forward_done(self) -> Marker | None:
        """In ``start_saves``, before starting them: a marker after the step's forward."""
        return self.record_marker()


def load_targets(loads: Sequence[RequestLoad]) -> list[Block]:
    """(group, block id) of every block ``loads`` write."""
    return [(t.group_id, b) for load in loads for t in load.groups for b in t.block_ids]
