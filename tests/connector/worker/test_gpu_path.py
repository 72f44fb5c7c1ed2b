"""The device path on a real GPU: two engines share a prefix through the pool (needs CUDA).

Engine A serves P1 and saves its blocks; engine B serves P2 (sharing P1's prefix) and loads
them. B's output must equal a reference run without the connector; the connector's
transfer threads hand the host only headers and checksums (``testing.host_crossings``);
the engine thread never synchronizes an event the connector recorded nor a
``torch.Stream`` (the connector's streams; vLLM's own waits, on ``torch.cuda`` objects,
are not counted). Skipped without CUDA: what it checks is also checked on CPU tensors
(``test_host_bytes``, ``test_host_waits``).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpool.connector.contract.object_header import HEADER_BYTES
from kvpool.connector.integrity.device_order import DeviceQueues
from testing.engine import (
    EngineOptions,
    create_llm,
    generate,
    reference_tokens,
    shutdown_llm,
    transfer_config,
    worker_of,
)
from testing.host_crossings import HostBytes
from testing.models import build_gemma3
from testing.prompts import MAX_TOKENS, P1, P2, PREFIX_HIT

pytestmark = [
    pytest.mark.device_path,
    pytest.mark.engine,
    pytest.mark.mooncake,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU data path needs CUDA"),
]


class OwnEvents(DeviceQueues):
    """The real queues; keeps the events the connector records, to tell its waits from vLLM's."""

    def __init__(self, inner: DeviceQueues):
        super().__init__(inner.device)
        self.events: set[int] = set()

    def record(self) -> Any:
        event = super().record()
        self.events.add(id(event))
        return event


def serve(model: Path, config: dict[str, Any], prompt: list[int], events: set[int]) -> tuple[Any, Any]:
    """Serve ``prompt`` on a fresh in-process engine; (its result, its ``WorkerSide``)."""
    llm = create_llm(EngineOptions(model=str(model), kv_transfer_config=config))
    try:
        worker = worker_of()
        assert worker.order.queues is not None and not worker.copiers[0].use_memmove, "the device path"
        queues = worker.order.queues = OwnEvents(worker.order.queues)
        queues.events = events
        (result,) = generate(llm, [prompt], MAX_TOKENS)
        worker.wait_for_saves()
        return result, worker
    finally:
        shutdown_llm(llm)


def objects(worker: Any, operation: str) -> int:
    return sum(sum(t.blocks) for t in worker.stats.transfers if t.operation == operation)


def test_two_engines_on_cuda_share_a_prefix(
    tmp_path: Path, pool_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_gemma3(tmp_path / "gemma3")
    reference = reference_tokens(model, [P2], MAX_TOKENS)[0]
    config = transfer_config(pool_settings)
    events: set[int] = set()
    engine_waits: list[str] = []
    event_sync, stream_sync = torch.Event.synchronize, torch.Stream.synchronize

    def event_synchronize(event: Any) -> None:
        if id(event) in events and threading.current_thread() is threading.main_thread():
            engine_waits.append("a connector event")
        event_sync(event)

    def stream_synchronize(stream: Any) -> None:  # the connector's streams are torch.Stream
        if type(stream) is torch.Stream and threading.current_thread() is threading.main_thread():
            engine_waits.append("a stream")
        stream_sync(stream)

    monkeypatch.setattr(torch.Event, "synchronize", event_synchronize)
    monkeypatch.setattr(torch.Stream, "synchronize", stream_synchronize)
    host = HostBytes(thread_prefix="kvpool-").install(monkeypatch)
    _, saver = serve(model, config, P1, events)
    save_bytes = host.total
    host.reset()
    result, loader = serve(model, config, P2, events)
    load_bytes = host.total
    monkeypatch.undo()

    assert result.token_ids == reference
    assert result.num_cached_tokens == PREFIX_HIT, "B took the prefix from the pool"
    assert objects(saver, "save") and objects(loader, "load")
    assert save_bytes <= 8 * objects(saver, "save"), f"A's saves handed the host {save_bytes} bytes"
    bound = (HEADER_BYTES + 8) * objects(loader, "load") + 8 * objects(loader, "save")
    assert load_bytes <= bound, f"B handed the host {load_bytes} bytes: {dict(host.by_method)}"
    assert engine_waits == [], "the engine thread waited for the device on the connector's account"
