"""No step writes a block while a save of an earlier step may still read it.

vLLM's model runner starts a step with ``_update_states``, which zeroes newly allocated
blocks (any model with Mamba layers or mixed-precision KV) and applies
``kv_cache_block_copies``, before it binds the connector's metadata. A save of the
previous step still reading a block those writes hit would store corrupted bytes; the
save barrier must therefore sit in ``handle_preemptions``, the step's first call, not in
``bind_connector_metadata``.

A real in-process engine (vLLM's V1 CPU model runner) with the connector. Each step's
saves wait on a marker of "the forward is still running" (the connector's device-order
hook; ``testing.device_queues.BlockingQueues`` plays the stream's wait by blocking the transfer
thread) that only ``_update_states`` or a timeout releases: a save that has not read its
blocks when ``_update_states`` runs (the worker still lists it as holding them, whether its
thread has started or not) is caught there. With the barrier in place it waits out the
marker, so no step ever starts with such a save; with the barrier moved back to
``bind_connector_metadata`` (the negative control) the very next step does.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testing.device_queues import BlockingQueues
from testing.engine import (
    EngineOptions,
    create_llm,
    generate,
    shutdown_llm,
    transfer_config,
    worker_of,
)
from testing.models import build_gemma3_full
from testing.prompts import P1, P2
from testing.worker import unreleased_saves

pytestmark = [pytest.mark.faults, pytest.mark.engine, pytest.mark.mooncake, pytest.mark.timeout(300)]

HOLD_S = 1.0  # how long a save waits for "the forward" unless a step starts first


class StillComputing:
    """A marker after work still running on the device: a transfer thread waits on it."""

    def __init__(self, watch: Watch):
        self.watch = watch
        self.released = threading.Event()

    def synchronize(self) -> None:
        if not threading.current_thread().name.startswith("kvpool-xfer"):
            return  # the engine's stream waiting for a save's reads: nothing held here
        with self.watch.lock:
            self.watch.waiting += 1
        try:
            self.released.wait(HOLD_S)
        finally:
            with self.watch.lock:
                self.watch.waiting -= 1
                self.watch.saves += 1


class Watch:
    """Counts saves that have not read their blocks when a step starts writing blocks."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting = 0
        self.saves = 0
        self.steps = 0
        self.caught: list[int] = []
        self.markers: list[StillComputing] = []
        self.worker: Any = None  # the engine's worker side, once it runs

    def saves_holding_blocks(self) -> int:
        """The worker's saves of earlier steps that have not read all their blocks yet: a save
        whose thread waits for its forward, and one whose thread has not even started."""
        if self.worker is None:
            return 0
        return sum(1 for job in unreleased_saves(self.worker) if not job.blocks_released)

    def marker(self) -> StillComputing:
        marker = StillComputing(self)
        self.markers.append(marker)
        return marker

    def step_starts(self) -> None:
        with self.lock:
            self.steps += 1
            if self.waiting or self.saves_holding_blocks():
                self.caught.append(self.steps)
        for marker in self.markers:
            marker.released.set()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3_full(tmp_path_factory.mktemp("gemma3-full"))


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Watch]:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    watch = Watch()
    update_states = GPUModelRunner._update_states

    def watched(self: Any, scheduler_output: Any) -> Any:
        watch.step_starts()  # zeroing and block copies happen inside, first thing
        return update_states(self, scheduler_output)

    monkeypatch.setattr(GPUModelRunner, "_update_states", watched)
    yield watch
    for marker in watch.markers:
        marker.released.set()


def _serve(model: Path, settings: Any, watch: Watch) -> None:
    llm = create_llm(EngineOptions(model=str(model), kv_transfer_config=transfer_config(settings)))
    try:
        worker = worker_of()
        assert not worker.order.drain_saves, "the V1 runner: saves overlap the next step"
        worker.order.queues = BlockingQueues(watch.marker)
        watch.worker = worker
        generate(llm, [P1], 4)  # a 10-block prefill, then decode steps
        generate(llm, [P2], 4)
    finally:
        shutdown_llm(llm)


def test_no_step_writes_blocks_before_earlier_saves_read_them(model, pool_settings, watch) -> None:
    _serve(model, pool_settings, watch)
    assert watch.saves >= 2, "saves ran, each waiting for its forward"
    assert watch.caught == [], f"steps {watch.caught} wrote blocks while a save had not read them"


def test_negative_control_a_barrier_at_bind_comes_too_late(model, pool_settings, watch, monkeypatch) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvpool.connector.connector import KVPoolConnector

    monkeypatch.setattr(KVPoolConnector, "handle_preemptions", KVConnectorBase_V1.handle_preemptions)
    _serve(model, pool_settings, watch)
    assert watch.caught, "without the barrier in handle_preemptions, a step starts under a save"


def test_under_a_runner_that_writes_blocks_first_saves_read_theirs_within_the_step(
    pool_client: Any, cache_prefix: str
) -> None:
    """vLLM's V2 model runner zeroes and copies blocks before ``handle_preemptions`` (it needs
    Triton, so it cannot run here): there ``start_saves`` returns only once this step's saves
    have read their blocks. A real ``WorkerSide`` and pool; the forward still "on the device"
    until the save thread's stream waits for it."""
    import torch

    from kvpool.connector.integrity.device_order import TransferOrder
    from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestSave
    from testing.worker import single_group_worker

    landed = threading.Event()

    class Forward:
        def synchronize(self) -> None:
            landed.wait(0.2)  # the device still computing, a moment
            landed.set()

    worker = single_group_worker(
        pool_client,
        cache_prefix,
        num_blocks=4,
        order=TransferOrder(queues=BlockingQueues(Forward), drain_saves=True),
    )
    try:
        worker.register_kv_caches({"l0": torch.zeros((2, 4, 32, 2, 16))})
        worker.start_saves(PoolConnectorMetadata(saves=[RequestSave("r", [GroupTransfer(0, ["b"], [1])])]))
        assert landed.is_set(), "the step ended before its save had read its blocks"
        assert not unreleased_saves(worker)
    finally:
        worker.shutdown()


def test_saves_read_their_blocks_within_the_step_where_no_next_step_may_come() -> None:
    """The V2 runner writes blocks before ``handle_preemptions``; with sleep mode vLLM may
    release the KV cache's memory after any step. Either way a step's saves read their
    blocks before the step ends; otherwise (the V1 runner) before the next forward."""
    from types import SimpleNamespace

    from kvpool.connector.connector import saves_read_blocks_within_the_step

    def config(v2: bool, sleep: bool) -> Any:
        return SimpleNamespace(use_v2_model_runner=v2, model_config=SimpleNamespace(enable_sleep_mode=sleep))

    assert not saves_read_blocks_within_the_step(config(v2=False, sleep=False))
    assert saves_read_blocks_within_the_step(config(v2=False, sleep=True))
    assert saves_read_blocks_within_the_step(config(v2=True, sleep=False))
