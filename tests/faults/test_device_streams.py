"""Transfer threads touch KV blocks only after the device work queued before them is done.

On an accelerator the forward (and vLLM's zeroing and copying of blocks) runs after the
call that queued it returned; a save that reads blocks at once reads stale KV, a load
that writes at once is overwritten by the zeroing queued before it. The connector records
an event on the engine's stream (``device_order.TransferOrder``) and every transfer
thread's stream waits for it (``stream.wait_event``) before the copies that touch a block.
There is no accelerator here, so the device is played by ``testing.device_queues``: a
marker stands for queued work that lands in memory once a stream waits for it: a save that
read before it would store the stale bytes, a load that wrote before it would be wiped.
Real Mooncake pool, real ``WorkerSide``, CPU tensors laid out as vLLM's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvpool.connector.integrity.device_order import TransferOrder, accelerator_queues
from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestLoad, RequestSave
from kvpool.connector.worker.side import WorkerSide
from testing.device_queues import RecordedQueues
from testing.worker import run_loads, single_group_worker

pytestmark = [pytest.mark.faults, pytest.mark.mooncake]

NUM_BLOCKS = 8
SHAPE = (2, NUM_BLOCKS, 32, 2, 16)  # K/V, blocks, tokens, heads, head size


@pytest.fixture
def rig(pool_client: Any, cache_prefix: str) -> Iterator[tuple[WorkerSide, torch.Tensor, RecordedQueues]]:
    queues = RecordedQueues()
    worker = single_group_worker(
        pool_client, cache_prefix, num_blocks=NUM_BLOCKS, order=TransferOrder(queues=queues), device_path=True
    )
    cache = torch.zeros(SHAPE)
    worker.register_kv_caches({"l0": cache})
    try:
        yield worker, cache, queues
    finally:
        worker.shutdown()


def test_a_save_reads_its_blocks_only_after_the_forward_is_done(rig) -> None:
    worker, cache, queues = rig
    computed = torch.randn(cache[:, 1].shape)  # what the forward writes into block 1
    queues.pending.append(lambda: cache[:, 1].copy_(computed))
    worker.start_saves(PoolConnectorMetadata(saves=[RequestSave("r", [GroupTransfer(0, ["b1"], [1])])]))
    (forward,) = queues.on(threading.current_thread().name, "record")  # the engine's event
    worker.wait_for_saves()
    assert forward is not None and forward.landed
    waits = [name for what, name, m in queues.calls if what == "wait_event" and m is forward]
    assert waits and all(name.startswith("kvpool-xfer") for name in waits), waits

    run_loads(worker, [RequestLoad("l", [GroupTransfer(0, ["b1"], [5])], 32)])
    assert worker.take_load_errors() == set()
    assert torch.equal(cache[:, 5], computed), "the stored block is the forward's, not the stale one"


def test_a_load_writes_its_blocks_only_after_the_queued_zeroing(rig) -> None:
    worker, cache, queues = rig
    cache[:, 2].normal_()
    worker.start_saves(PoolConnectorMetadata(saves=[RequestSave("r", [GroupTransfer(0, ["b2"], [2])])]))
    worker.wait_for_saves()
    stored = cache[:, 2].clone()

    # vLLM queued the zeroing of the newly allocated block 6 before this step's loads.
    cache[:, 6].fill_(7.0)
    queues.pending.append(lambda: cache[:, 6].zero_())
    run_loads(worker, [RequestLoad("l", [GroupTransfer(0, ["b2"], [6])], 32)])
    assert not queues.pending and all(m.landed for what, _, m in queues.calls if m is not None)
    assert worker.take_load_errors() == set()
    assert torch.equal(cache[:, 6], stored), "the load landed after the zeroing, not under it"


def test_nothing_is_queued_on_the_cpu() -> None:
    assert accelerator_queues() is None
    assert TransferOrder().forward_done() is None
