"""Staging copies: the CPU path (memmove) and the device path (indexed torch copies, run here on
CPU tensors) move the same bytes between blocks and staged objects, and never outside the cache;
each takes its own payload checksum and checks whichever one a header names."""

from __future__ import annotations

import pytest
import torch

from kvpool.connector.contract.object_header import HEADER_BYTES, ObjectIdentity, pack_header
from kvpool.connector.contract.payload_checks import Checksum, crc32c, word_sums_of
from kvpool.connector.worker.block_regions import describe_layer
from kvpool.connector.worker.staging import GroupCopier, StagingSlot

NUM_BLOCKS = 12
SHAPE = (2, NUM_BLOCKS, 32, 2, 16)  # K/V, blocks, tokens, heads, head size


def caches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(SHAPE, generator=gen) for _ in range(3)]


def copier(tensors: list[torch.Tensor], *, use_memmove: bool) -> GroupCopier:
    return GroupCopier([describe_layer(t, NUM_BLOCKS) for t in tensors], tensors, use_memmove=use_memmove)


@pytest.fixture
def device_slot(monkeypatch: pytest.MonkeyPatch) -> StagingSlot:
    """A CPU buffer that takes the accelerator's code paths (nothing queued to wait for)."""
    slot = StagingSlot(1 << 20, torch.device("cpu"), device_path=True)
    assert not slot.on_cpu
    monkeypatch.setattr(StagingSlot, "synchronize", lambda self: None)
    return slot


def test_both_paths_stage_the_same_bytes(device_slot: StagingSlot) -> None:
    tensors = caches()
    host_slot = StagingSlot(1 << 20, torch.device("cpu"))
    blocks = [3, 1, 7]
    copier(tensors, use_memmove=True).from_blocks(host_slot, blocks)
    device = copier(tensors, use_memmove=False)
    device.from_blocks(device_slot, blocks)
    size = device.object_bytes
    assert size == HEADER_BYTES + 3 * 2 * 32 * 2 * 16 * 4
    for i, block in enumerate(blocks):
        payload = host_slot.tensor[i * size + HEADER_BYTES : (i + 1) * size]
        assert torch.equal(payload, device_slot.tensor[i * size + HEADER_BYTES : (i + 1) * size])
        # Layer by layer, K then V: the object's payload is the block's runs in order.
        runs = [t[kv, block].contiguous().view(torch.uint8).flatten() for t in tensors for kv in range(2)]
        assert torch.equal(payload, torch.cat(runs))


CHECKSUMS = {Checksum.CRC32C: crc32c, Checksum.WORD_SUMS: word_sums_of}


@pytest.mark.parametrize(("use_memmove", "kind"), [(True, Checksum.CRC32C), (False, Checksum.WORD_SUMS)])
def test_staging_returns_each_payloads_checksum(
    use_memmove: bool, kind: Checksum, device_slot: StagingSlot
) -> None:
    """A save's copy into staging and its checksums (CRC-32C object by object on the CPU, word
    sums on the device): the same bytes as :meth:`GroupCopier.from_blocks` stages."""
    tensors = caches()
    slot = StagingSlot(1 << 20, torch.device("cpu")) if use_memmove else device_slot
    reference = StagingSlot(1 << 20, torch.device("cpu"))
    group = copier(tensors, use_memmove=use_memmove)
    checks = group.stage(slot, [4, 0, 9])
    assert group.checksum is kind
    copier(tensors, use_memmove=True).from_blocks(reference, [4, 0, 9])
    size = group.object_bytes
    for i, check in enumerate(checks):
        payload = slot.tensor[i * size + HEADER_BYTES : (i + 1) * size]
        assert torch.equal(payload, reference.tensor[i * size + HEADER_BYTES : (i + 1) * size])
        assert check == CHECKSUMS[kind](payload.numpy().tobytes())
    assert len(set(checks)) == 3


@pytest.mark.parametrize("use_memmove", [True, False])
def test_staged_objects_fill_exactly_their_blocks(use_memmove: bool, device_slot: StagingSlot) -> None:
    tensors = caches()
    slot = StagingSlot(1 << 20, torch.device("cpu")) if use_memmove else device_slot
    group = copier(tensors, use_memmove=use_memmove)
    group.from_blocks(slot, [1, 2])
    before = [t.clone() for t in tensors]
    group.to_blocks(slot, [(0, 9), (1, 10)])
    for t, old in zip(tensors, before, strict=True):
        assert torch.equal(t[:, 9], old[:, 1]) and torch.equal(t[:, 10], old[:, 2])
        untouched = [b for b in range(NUM_BLOCKS) if b not in (9, 10)]
        assert torch.equal(t[:, untouched], old[:, untouched])


@pytest.mark.parametrize("kind", list(Checksum))
@pytest.mark.parametrize("use_memmove", [True, False])
def test_only_payloads_as_their_headers_state_reach_the_blocks(
    use_memmove: bool, kind: Checksum, device_slot: StagingSlot
) -> None:
    """The load's check and copy (object by object on the CPU), with the checksum each header
    names whichever path reads it: a payload whose checksum is not its header's is reported (a
    CRC-32C one on the CPU is checked on its block after the copy and leaves it zeroed; any
    other leaves its block as it was); the others are copied."""
    tensors = caches()
    slot = StagingSlot(1 << 20, torch.device("cpu")) if use_memmove else device_slot
    group = copier(tensors, use_memmove=use_memmove)
    group.from_blocks(slot, [1, 2, 3])
    size = group.object_bytes
    payloads = [slot.tensor[i * size + HEADER_BYTES : (i + 1) * size].numpy().tobytes() for i in range(3)]
    identity = ObjectIdentity("f" * 16, "d" * 64, 0, 0, 0, payload_bytes=size - HEADER_BYTES)
    headers = [pack_header(identity, CHECKSUMS[kind](p), kind) for p in payloads]
    slot.tensor[1 * size + HEADER_BYTES + 5] += 1  # object 1's payload after its header was written
    before = [t.clone() for t in tensors]
    assert group.to_blocks_if_intact(slot, [(0, 9), (1, 10), (2, 11)], headers) == [1]
    for t, old in zip(tensors, before, strict=True):
        assert torch.equal(t[:, 9], old[:, 1]) and torch.equal(t[:, 11], old[:, 3])
        if use_memmove and kind is Checksum.CRC32C:  # checked on the block after its copy
            assert not t[:, 10].any(), "a payload that failed on its block leaves zeros there"
        else:
            assert torch.equal(t[:, 10], old[:, 10]), "a payload not as stated is never copied"


def test_headers_round_trip_on_both_paths(device_slot: StagingSlot) -> None:
    headers = [bytes([i]) * HEADER_BYTES for i in range(3)]
    for slot in (StagingSlot(1 << 20, torch.device("cpu")), device_slot):
        slot.write_headers(headers, 4096)
        assert slot.read_headers(3, 4096) == headers


def test_a_header_naming_no_known_checksum_matches_no_payload(device_slot: StagingSlot) -> None:
    tensors = caches()
    for use_memmove, slot in ((True, StagingSlot(1 << 20, torch.device("cpu"))), (False, device_slot)):
        group = copier(tensors, use_memmove=use_memmove)
        group.from_blocks(slot, [1])
        identity = ObjectIdentity("f" * 16, "d" * 64, 0, 0, 0, payload_bytes=group.payload_bytes)
        header = bytearray(pack_header(identity, 0))
        header[52] = 9  # a checksum kind of a later version
        assert group.to_blocks_if_intact(slot, [(0, 5)], [bytes(header)]) == [0]


def test_payload_crcs_are_the_crc_of_each_payload_on_both_paths(device_slot: StagingSlot) -> None:
    import google_crc32c

    tensors = caches()
    host_slot = StagingSlot(1 << 20, torch.device("cpu"))
    copier(tensors, use_memmove=True).from_blocks(host_slot, [3, 1, 7])
    device = copier(tensors, use_memmove=False)
    device.from_blocks(device_slot, [3, 1, 7])
    size = device.object_bytes
    payloads = [host_slot.tensor[i * size + HEADER_BYTES : (i + 1) * size] for i in (2, 0)]
    expected = [google_crc32c.value(p.numpy().tobytes()) for p in payloads]
    assert len(set(expected)) == 2, "two blocks of random KV differ"
    assert host_slot.payload_crcs([2, 0], size) == expected
    assert device_slot.payload_crcs([2, 0], size) == expected
    host_slot.write_headers([b"\xff" * HEADER_BYTES], size)  # the header is not part of the payload
    assert host_slot.payload_crcs([0], size) == expected[1:]
    assert host_slot.payload_crcs([], size) == device_slot.payload_crcs([], size) == []


def test_a_block_outside_the_cache_is_refused_before_any_copy() -> None:
    tensors = caches()
    group = copier(tensors, use_memmove=True)
    slot = StagingSlot(1 << 20, torch.device("cpu"))
    with pytest.raises(IndexError):
        group.from_blocks(slot, [NUM_BLOCKS])
    with pytest.raises(IndexError):
        group.to_blocks(slot, [(0, -1)])


def test_a_load_reads_ahead_only_when_it_is_long_and_two_objects_fit() -> None:
    from kvpool.connector.worker.side import LOAD_BATCH_BYTES, load_batches, read_ahead_bytes

    obj, batch = 1 << 20, LOAD_BATCH_BYTES
    short = batch // obj
    assert load_batches(short, obj, 64 * obj, batch) == (short, 1), "fits one read: no read-ahead"
    assert load_batches(100, obj, 64 * obj, batch) == (short, 2), "long: batches of LOAD_BATCH_BYTES"
    assert load_batches(100, obj, 64 * obj, None) == (64, 1), "no read-ahead: reads fill the buffer"
    assert load_batches(100, obj, 4 * obj, batch) == (2, 2), "a small buffer: each half holds half of it"
    assert load_batches(100, obj, obj + 1, batch) == (1, 1), "one object fits: read, copy, read again"
    assert load_batches(3, 4 * batch, 1, batch) == (1, 1), "larger than the buffer: one at a time"
    assert read_ahead_bytes(1 << 30) == batch and read_ahead_bytes(0) is None, "only with a segment"
