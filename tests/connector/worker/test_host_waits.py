"""The engine thread never waits for the device: every ordering is a stream waiting for an event.

A real Mooncake pool and a real ``WorkerSide`` on the device path (forced on CPU tensors),
driven through steps as vLLM's worker calls it (barrier, loads, forward, saves, results).
The device's queues are ``testing.device_queues.RecordedQueues`` (there is no accelerator
here): it records every ``synchronize`` and every ``wait_event`` with the thread that made
it. Per step: no ``synchronize`` on the engine thread; loads' streams wait for the event the
engine recorded before them; the barrier makes the engine's stream wait for the saves' reads.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from kvpool.connector.integrity.device_order import TransferOrder
from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestLoad, RequestSave
from testing.device_queues import RecordedQueues
from testing.worker import single_group_worker

pytestmark = [pytest.mark.mooncake, pytest.mark.device_path]

NUM_BLOCKS = 32
SHAPE = (2, NUM_BLOCKS, 32, 2, 16)
STEPS = 4


def test_no_step_synchronizes_the_engine_thread(pool_client: Any, cache_prefix: str) -> None:
    queues = RecordedQueues()
    worker = single_group_worker(
        pool_client, cache_prefix, num_blocks=NUM_BLOCKS, order=TransferOrder(queues=queues), device_path=True
    )
    cache = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    worker.register_kv_caches({"l0": cache})
    engine = threading.current_thread().name
    try:
        pending: set[str] = set()
        for step in range(STEPS):
            # Step k saves blocks 2k, 2k+1 and loads what step k-1 saved into blocks 16+2k...
            worker.before_forward()  # handle_preemptions: the save barrier
            loads = []
            if step:
                digests = [f"s{step - 1}-{i}" for i in range(2)]
                blocks = [16 + 2 * step, 17 + 2 * step]
                loads = [RequestLoad(f"l{step}", [GroupTransfer(0, digests, blocks)], 64)]
                pending.add(f"l{step}")
            worker.start_loads(PoolConnectorMetadata(loads=loads))
            save = GroupTransfer(0, [f"s{step}-{i}" for i in range(2)], [2 * step, 2 * step + 1])
            worker.start_saves(PoolConnectorMetadata(saves=[RequestSave(f"s{step}", [save])]))
            done, failed = worker.transfer_results()
            pending -= done
            assert not failed
            assert queues.on(engine, "synchronize") == [], f"step {step} synchronized the engine thread"
            worker.wait_for_saves()  # published before the next step's lookup would find them
        worker.before_forward()
        worker.wait_for_saves()
        while pending:  # the last loads, reported in later steps (bounded by the load deadline)
            done, failed = worker.transfer_results(idle=True)
            pending -= done
            assert not failed
    finally:
        worker.shutdown()

    assert queues.on(engine, "synchronize") == []
    assert worker.take_load_errors() == set()
    for step in range(1, STEPS):
        assert torch.equal(cache[:, 16 + 2 * step], cache[:, 2 * (step - 1)])
    # Loads and saves: a transfer stream waits for the engine's events (zeroing, forward).
    engine_markers = {id(m) for m in queues.on(engine, "record")}
    transfer_waits = [m for t in queues.transfer_threads for m in queues.on(t, "wait_event")]
    assert len(engine_markers) == 2 * STEPS - 1, "one before each step's loads, one after each forward"
    assert {id(m) for m in transfer_waits} == engine_markers
    # The barrier: the engine's stream waits for every save's reads of its blocks.
    barrier_waits = queues.on(engine, "wait_event")
    assert len(barrier_waits) == STEPS
    assert all(m is not None and m.recorded_on.startswith("kvpool-xfer") for m in barrier_waits)
