"""The device path moves no payload to the host: only headers and checksums cross.

A real Mooncake pool and a real ``WorkerSide`` whose data path is forced onto the
accelerator's code (``device_path=True``) over CPU tensors: every torch call that would
hand a device tensor's bytes to the host is counted (``testing.host_crossings``). A save of
N blocks hands the host each object's 8-byte checksum; a load each object's header and
checksum. Before the payload checksum was taken on the device, both copied every payload.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvpool.connector.contract.object_header import HEADER_BYTES
from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestLoad, RequestSave
from kvpool.connector.worker.side import WorkerSide
from testing.host_crossings import HostBytes
from testing.worker import run_loads, single_group_worker

pytestmark = [pytest.mark.mooncake, pytest.mark.device_path]

NUM_BLOCKS = 24
BLOCKS = 10  # saved and loaded
SHAPE = (2, NUM_BLOCKS, 32, 2, 16)  # K/V, blocks, tokens, heads, head size: 8 KiB a block (fp32)
CHECKSUM_BYTES = 8


@pytest.fixture
def rig(pool_client: Any, cache_prefix: str) -> Iterator[tuple[WorkerSide, torch.Tensor]]:
    worker = single_group_worker(pool_client, cache_prefix, num_blocks=NUM_BLOCKS, device_path=True)
    cache = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    worker.register_kv_caches({"l0": cache})
    try:
        yield worker, cache
    finally:
        worker.shutdown()


def test_a_save_and_a_load_hand_the_host_a_few_bytes_an_object(
    rig: tuple[WorkerSide, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, cache = rig
    digests = [f"d{i}" for i in range(BLOCKS)]
    saved, loaded_into = list(range(BLOCKS)), list(range(BLOCKS, 2 * BLOCKS))
    payload_bytes = worker.copiers[0].payload_bytes  # type: ignore[union-attr]
    host = HostBytes().install(monkeypatch)

    worker.start_saves(PoolConnectorMetadata(saves=[RequestSave("s", [GroupTransfer(0, digests, saved)])]))
    worker.before_forward()
    worker.wait_for_saves()
    save_bytes = host.total
    host.reset()
    run_loads(worker, [RequestLoad("l", [GroupTransfer(0, digests, loaded_into)], 32 * BLOCKS)])
    load_bytes = host.total
    monkeypatch.undo()

    assert worker.take_load_errors() == set()
    assert torch.equal(cache[:, loaded_into], cache[:, saved]), "every block loaded, byte for byte"
    assert save_bytes <= BLOCKS * CHECKSUM_BYTES, f"a save handed the host {save_bytes} bytes"
    assert load_bytes <= BLOCKS * (HEADER_BYTES + CHECKSUM_BYTES), (
        f"a load handed the host {load_bytes} bytes"
    )
    assert BLOCKS * payload_bytes > 100 * (save_bytes + load_bytes), "the payloads never crossed"
