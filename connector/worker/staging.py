"""Staging: the registered buffers pool objects move through, and the copies to and from blocks.

Every transfer thread owns one staging buffer. A Mooncake call reads or writes
only its thread's buffer (or, reading ahead for a long load, the half of it the
thread is not copying), one contiguous object (``header | payload``) per key;
vLLM's KV blocks are read (saves) and written (loads) only by this process's
own copies between that buffer and the blocks. Hence:

* a call that outlives its deadline (a frozen store) can write into nothing but
  its thread's buffer, which that thread reuses only after the call returned;
* a loaded object reaches the blocks only after its header is checked;
* a save reads its blocks once, quickly, and never while the store is slow.

On the CPU the copies are ``memmove`` s of each block's runs; on an accelerator
they are indexed copies on the device, synchronised before the buffer is handed
to Mooncake or the blocks to the forward.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.connector.contract.object_header import HEADER_BYTES, payload_crc, payload_matches
from kvpool.connector.worker.block_regions import LayerBlocks


@dataclass(frozen=True)
class Run:
    """One contiguous run of every block of a layer (e.g. its K or its V)."""

    base: int  # address of block 0's run
    block_stride: int
    size: int
    offset: int  # where the run sits in an object (after the header)
    num_blocks: int
    tensor: Any = None  # the layer's cache tensor (device copies)


class GroupCopier:
    """Copies one KV-cache group's blocks between vLLM's cache and staged objects."""

    def __init__(self, layers: Sequence[LayerBlocks], tensors: Sequence[Any], *, use_memmove: bool):
        runs: list[Run] = []
        offset = HEADER_BYTES
        for layer, tensor in zip(layers, tensors, strict=True):
            for outer in layer.outer_offsets:
                size, stride = layer.segment_bytes, layer.block_stride
                runs.append(Run(layer.base + outer, stride, size, offset, layer.num_blocks, tensor))
                offset += size
        self.runs = runs
        self.object_bytes = offset
        self.payload_bytes = offset - HEADER_BYTES
        self.use_memmove = use_memmove
        self.num_blocks = min((run.num_blocks for run in runs), default=0)
        self._views: list[Any] | None = None

    @classmethod
    def header_only(cls, num_blocks: int) -> GroupCopier:
        """A group with no layers on this rank (another pipeline stage holds them all).

        Its objects are a header and no payload: every rank still publishes a key per
        block, so a hit (which needs every rank's key) is found, and a load checks the
        header and copies nothing.
        """
        copier = cls([], [], use_memmove=True)
        copier.num_blocks = num_blocks
        return copier

    def check(self, block_ids: Sequence[int]) -> None:
        """Raise ``IndexError`` unless every id names a block of the cache (before any copy)."""
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):
            raise IndexError(f"block id outside 0..{self.num_blocks - 1}: {min(block_ids)}..{max(block_ids)}")

    # --- blocks -> staging (saves) ---------------------------------------------
    def from_blocks(self, slot: StagingSlot, block_ids: Sequence[int]) -> None:
        """Copy each block's payload into object ``i`` of ``slot``."""
        self.check(block_ids)
        if self.use_memmove:
            for i, block in enumerate(block_ids):
                self._block_into_object(block, slot.ptr + i * self.object_bytes)
            return
        import torch

        index = torch.tensor(list(block_ids), dtype=torch.long, device=slot.tensor.device)
        objects = slot.objects(len(block_ids), self.object_bytes)
        for run, view in zip(self.runs, self._block_views()):
            objects[:, run.offset : run.offset + run.size].copy_(view.index_select(0, index))
        slot.synchronize()

    def stage(self, slot: StagingSlot, block_ids: Sequence[int]) -> list[int]:
        """:meth:`from_blocks`, returning each staged payload's CRC-32C.

        On the CPU each object's CRC is taken right after its copy, while its payload
        is still in the core's cache.
        """
        if not self.use_memmove:
            self.from_blocks(slot, block_ids)
            return slot.payload_crcs(range(len(block_ids)), self.object_bytes)
        self.check(block_ids)
        payload = ctypes.c_char * self.payload_bytes
        crcs = []
        for i, block in enumerate(block_ids):
            obj = slot.ptr + i * self.object_bytes
            self._block_into_object(block, obj)
            crcs.append(payload_crc(payload.from_address(obj + HEADER_BYTES)))
        return crcs

    # --- staging -> blocks (loads) ---------------------------------------------
    def to_blocks(self, slot: StagingSlot, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy object ``i`` of ``slot`` into block ``b`` for each ``(i, b)`` of ``pairs``."""
        if not pairs:
            return
        self.check([b for _, b in pairs])
        if self.use_memmove:
            for i, block in pairs:
                self._object_into_block(slot.ptr + i * self.object_bytes, block)
            return
        import torch

        device = slot.tensor.device
        rows = torch.tensor([i for i, _ in pairs], dtype=torch.long, device=device)
        index = torch.tensor([b for _, b in pairs], dtype=torch.long, device=device)
        objects = slot.objects(max(i for i, _ in pairs) + 1, self.object_bytes).index_select(0, rows)
        for run, view in zip(self.runs, self._block_views()):
            view.index_copy_(0, index, objects[:, run.offset : run.offset + run.size])
        slot.synchronize()

    def to_blocks_if_intact(
        self, slot: StagingSlot, pairs: Sequence[tuple[int, int]], headers: Sequence[bytes]
    ) -> list[int]:
        """Like :meth:`to_blocks`, but only objects whose payload is as header ``headers[k]`` states.

        Returns the positions ``k`` in ``pairs`` whose payload did not match its header's
        CRC-32C (nothing of them is copied). On the CPU each object is checked and copied
        before the next one is read, so the copy reads the payload from the cache the check
        just filled.
        """
        if not self.use_memmove:
            crcs = slot.payload_crcs([i for i, _ in pairs], self.object_bytes)
            checked = enumerate(zip(headers, crcs, strict=True))
            bad = [k for k, (header, crc) in checked if not payload_matches(header, crc)]
            rejected = set(bad)
            self.to_blocks(slot, [pair for k, pair in enumerate(pairs) if k not in rejected])
            return bad
        self.check([b for _, b in pairs])
        payload = ctypes.c_char * self.payload_bytes
        bad = []
        for k, ((i, block), header) in enumerate(zip(pairs, headers, strict=True)):
            obj = slot.ptr + i * self.object_bytes
            if payload_matches(header, payload_crc(payload.from_address(obj + HEADER_BYTES))):
                self._object_into_block(obj, block)
            else:
                bad.append(k)
        return bad

    # --- one object on the CPU: a memmove per run --------------------------------
    def _block_into_object(self, block: int, obj: int) -> None:
        move = ctypes.memmove
        for run in self.runs:
            move(obj + run.offset, run.base + block * run.block_stride, run.size)

    def _object_into_block(self, obj: int, block: int) -> None:
        move = ctypes.memmove
        for run in self.runs:
            move(run.base + block * run.block_stride, obj + run.offset, run.size)

    def _block_views(self) -> list[Any]:
        """Per run: a ``(num_blocks, size)`` byte view of the layer's cache (device copies)."""
        if self._views is None:
            import torch

            views = []
            for run in self.runs:
                storage = run.tensor.untyped_storage()
                flat = torch.empty(0, dtype=torch.uint8, device=run.tensor.device).set_(storage)
                start = run.base - storage.data_ptr()
                views.append(flat.as_strided((run.num_blocks, run.size), (run.block_stride, 1), start))
            self._views = views
        return self._views


class StagingSlot:
    """One registered staging buffer, on the device of the KV cache."""

    def __init__(self, nbytes: int, device: Any):
        import torch

        self._hold(torch.empty(nbytes, dtype=torch.uint8, device=device))

    def _hold(self, tensor: Any) -> None:
        """Be the buffer of ``tensor`` (a 1-D byte tensor)."""
        self.tensor = tensor
        self.ptr = int(tensor.data_ptr())
        self.nbytes = int(tensor.numel())
        self.on_cpu = tensor.device.type == "cpu"

    def part(self, offset: int, nbytes: int) -> StagingSlot:
        """Bytes ``offset..offset+nbytes`` of this buffer, as a buffer of its own (same registration)."""
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"part {offset}+{nbytes} outside a {self.nbytes}-byte buffer")
        part = StagingSlot.__new__(StagingSlot)
        part._hold(self.tensor[offset : offset + nbytes])
        return part

    def objects(self, count: int, object_bytes: int) -> Any:
        """The first ``count`` objects as a ``(count, object_bytes)`` byte tensor."""
        return self.tensor[: count * object_bytes].view(count, object_bytes)

    def write_headers(self, headers: Sequence[bytes], object_bytes: int) -> None:
        """Put ``headers[i]`` at the start of object ``i``."""
        if self.on_cpu:
            for i, header in enumerate(headers):
                ctypes.memmove(self.ptr + i * object_bytes, header, len(header))
            return
        import torch

        host = torch.frombuffer(bytearray(b"".join(headers)), dtype=torch.uint8).view(len(headers), -1)
        self.objects(len(headers), object_bytes)[:, : host.shape[1]].copy_(host)
        self.synchronize()

    def read_headers(self, count: int, object_bytes: int) -> list[bytes]:
        """The first ``HEADER_BYTES`` of objects ``0..count-1``."""
        if self.on_cpu:
            return [ctypes.string_at(self.ptr + i * object_bytes, HEADER_BYTES) for i in range(count)]
        host = self.objects(count, object_bytes)[:, :HEADER_BYTES].cpu()
        return [bytes(row.numpy().tobytes()) for row in host]

    def payload_crcs(self, indices: Sequence[int], object_bytes: int) -> list[int]:
        """The CRC-32C of the payload (the bytes after the header) of each object in ``indices``."""
        if self.on_cpu:
            view = ctypes.c_char * (object_bytes - HEADER_BYTES)
            start = self.ptr + HEADER_BYTES
            return [payload_crc(view.from_address(start + i * object_bytes)) for i in indices]
        if not indices:
            return []
        import torch

        rows = torch.tensor(list(indices), dtype=torch.long, device=self.tensor.device)
        objects = self.objects(max(indices) + 1, object_bytes).index_select(0, rows)
        host = objects[:, HEADER_BYTES:].cpu().contiguous()
        return [payload_crc(row.numpy()) for row in host]

    def synchronize(self) -> None:
        """Wait for this thread's device copies (nothing to wait for on the CPU)."""
        if self.on_cpu:
            return
        import torch

        torch.accelerator.current_stream(self.tensor.device).synchronize()
