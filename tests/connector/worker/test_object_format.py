"""The object format on a real pool: writers of either checksum share it, old objects are refused.

A worker whose cache is in host memory stores CRC-32C objects; one on an accelerator stores
``WORD_SUMS`` objects (the device path, forced here on CPU tensors). A reader checks the
checksum each header names, so both load from one fleet's pool. An object of the previous
format (version 2: a CRC-32C at byte 52, no checksum kind) found under a key of this one is
a failed load (recomputed), never read as this format.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvpool.connector.contract.object_header import HEADER_BYTES, payload_crc, stated_checksum
from kvpool.connector.contract.payload_checks import Checksum
from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestLoad, RequestSave
from kvpool.connector.pool_client import CODE_RPC_FAILED
from kvpool.connector.worker.side import WorkerSide
from testing.mooncake_faults import mooncake_store_class
from testing.pool_store import raw_store
from testing.worker import run_loads, single_group_worker

pytestmark = pytest.mark.mooncake

NUM_BLOCKS = 8
SHAPE = (2, NUM_BLOCKS, 32, 2, 16)  # K/V, blocks, tokens, heads, head size
PATHS = {"cpu": None, "device": True}  # WorkerSide(device_path=...)


@pytest.fixture
def workers(pool_client: Any, cache_prefix: str) -> Iterator[dict[str, WorkerSide]]:
    """A CPU-path and a device-path worker of one layout, each with a cache of its own."""
    made = {}
    for seed, (name, device_path) in enumerate(PATHS.items()):
        worker = single_group_worker(
            pool_client, cache_prefix, num_blocks=NUM_BLOCKS, device_path=device_path
        )
        worker.register_kv_caches({"l0": torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))})
        made[name] = worker
    try:
        yield made
    finally:
        for worker in made.values():
            worker.shutdown()


def cache(worker: WorkerSide) -> torch.Tensor:
    return worker.copiers[0].runs[0].tensor  # type: ignore[union-attr]


def save(worker: WorkerSide, digest: str, block: int) -> None:
    worker.start_saves(PoolConnectorMetadata(saves=[RequestSave("s", [GroupTransfer(0, [digest], [block])])]))
    worker.before_forward()
    worker.wait_for_saves()


def load(worker: WorkerSide, digest: str, block: int) -> set[int]:
    """Load ``digest`` into ``block``; the block ids whose load failed (vLLM recomputes them)."""
    run_loads(worker, [RequestLoad("l", [GroupTransfer(0, [digest], [block])], 32)])
    return worker.take_load_errors()


@pytest.mark.parametrize(("writer", "reader"), [("cpu", "device"), ("device", "cpu")])
def test_a_reader_checks_the_checksum_the_writer_took(
    writer: str, reader: str, workers: dict[str, WorkerSide], pool_client: Any
) -> None:
    kinds = {"cpu": Checksum.CRC32C, "device": Checksum.WORD_SUMS}
    source, target = workers[writer], workers[reader]
    save(source, "a", 1)
    stored = raw_store(pool_client).get(source.keyspace.key(0, 0, 0, "a"))
    assert stated_checksum(stored[:HEADER_BYTES]) is kinds[writer]
    assert load(target, "a", 5) == set()
    assert torch.equal(cache(target)[:, 5], cache(source)[:, 1]), "the writer's block, byte for byte"

    # Damaged behind its header: the reader's check of the writer's kind refuses it.
    damaged = bytearray(stored)
    damaged[HEADER_BYTES + 11] ^= 0x04
    assert raw_store(pool_client).upsert(source.keyspace.key(0, 0, 0, "a"), bytes(damaged)) == 0
    before = cache(target)[:, 6].clone()
    assert load(target, "a", 6) == {6}
    assert torch.equal(cache(target)[:, 6], before)


def as_version_2(stored: bytes) -> bytes:
    """``stored`` as version 2 wrote it: version byte 2, the fields CRC anew, then the payload's
    CRC-32C where version 3 keeps the checksum's kind."""
    header = bytearray(stored[:HEADER_BYTES])
    header[4] = 2
    header[48:52] = struct.pack("<I", zlib.crc32(bytes(header[:48])))
    header[52:] = struct.pack("<I", payload_crc(stored[HEADER_BYTES:])) + bytes(8)
    return bytes(header) + stored[HEADER_BYTES:]


@pytest.mark.parametrize("path", list(PATHS))
def test_an_object_of_the_previous_format_is_a_failed_load(
    path: str, workers: dict[str, WorkerSide], pool_client: Any
) -> None:
    worker = workers[path]
    save(worker, "old", 2)
    key = worker.keyspace.key(0, 0, 0, "old")
    store = raw_store(pool_client)
    assert store.upsert(key, as_version_2(store.get(key))) == 0
    cache(worker)[:, 4] = 0
    worker.stats.drain()
    assert load(worker, "old", 4) == {4}, "refused: vLLM recomputes the block"
    assert not cache(worker)[:, 4].any(), "no byte of the old object reached the block"
    (loaded,) = [t for t in worker.stats.transfers if t.operation == "load"]
    assert loaded.failures == {"corrupt": 1}


def test_a_failed_removal_of_a_corrupt_object_leaves_the_load_reported_as_it_ended(
    workers: dict[str, WorkerSide], pool_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Removing a corrupt object is best effort: a removal call that raises leaves the object
    (the next reader refuses it too) and the load is reported as it ended, corrupt, not held
    until its deadline and reported as a timeout."""
    worker = workers["cpu"]
    save(worker, "damaged", 1)
    key = worker.keyspace.key(0, 0, 0, "damaged")
    store = raw_store(pool_client)
    damaged = bytearray(store.get(key))
    damaged[HEADER_BYTES + 5] ^= 0x10
    assert store.upsert(key, bytes(damaged)) == 0

    def removal_fails(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected: batch_remove raised")

    monkeypatch.setattr(mooncake_store_class(), "batch_remove", removal_fails)
    worker.stats.drain()
    assert load(worker, "damaged", 3) == {3}
    (loaded,) = [t for t in worker.stats.transfers if t.operation == "load"]
    assert loaded.failures == {"corrupt": 1}
    assert worker.client.remove([key]) == [CODE_RPC_FAILED]
