"""Staging: the registered buffers pool objects move through, and the copies to and from blocks.

Every transfer thread owns one staging buffer. A Mooncake call reads or writes
only its thread's buffer (or, reading ahead for a long load, the half of it the
thread is not copying), one contiguous object (``header | payload``) per key;
vLLM's KV blocks are read (saves) and written (loads) only by this process's
own copies between that buffer and the blocks. Hence:

* a call that outlives its deadline (a frozen store) can write into nothing but
  its thread's buffer, which that thread reuses only after the call returned;
* a loaded object reaches the blocks only after its header is checked, and a load
  reports a block loaded only once its payload is checked (on the CPU, on the block
  right after the copy);
* a save reads its blocks once, quickly, and never while the store is slow.

On the CPU the copies are ``memmove`` s of each block's runs and a payload's
checksum is its CRC-32C; on an accelerator (the *device path*) they are indexed
copies on the device, and a payload's checksum is ``WORD_SUMS``, computed on the
device: only headers and 8-byte checksums cross to the host, never a payload.
A load checks each payload with the checksum its header names, whichever path
wrote it (:mod:`kvpool.connector.contract.payload_checks`); a CRC-32C object
read on the device path is the one case whose payload is copied to the host.
The device path's copies are synchronised before the buffer is handed to
Mooncake or the blocks to the forward.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.connector.contract.object_header import HEADER_BYTES, payload_matches, stated_checksum
from kvpool.connector.contract.payload_checks import Checksum, crc32c, crc32c_extend, word_sums
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
        self._run_types = [ctypes.c_char * run.size for run in runs]  # a run's bytes, as a ctypes type
        self.object_bytes = offset
        self.payload_bytes = offset - HEADER_BYTES
        self.use_memmove = use_memmove
        # The checksum this copier's saves take (a load checks whichever its header names).
        self.checksum = Checksum.CRC32C if use_memmove else Checksum.WORD_SUMS
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
    def from_blocks(self, slot: StagingSlot, block_ids: Sequence[int], *, synchronize: bool = True) -> None:
        """Copy each block's payload into object ``i`` of ``slot``.

        ``synchronize=False`` (device path): return once the copies are queued on this
        thread's stream; whatever it queues next runs after them.
        """
        self.check(block_ids)
        if self.use_memmove:
            for i, block in enumerate(block_ids):
                self._block_into_object(block, slot.ptr + i * self.object_bytes)
            return
        index = device_index(block_ids, slot.tensor.device)
        objects = slot.objects(len(block_ids), self.object_bytes)
        for run, view in zip(self.runs, self._block_views()):
            objects[:, run.offset : run.offset + run.size].copy_(view.index_select(0, index))
        if synchronize:
            slot.synchronize()

    def stage(self, slot: StagingSlot, block_ids: Sequence[int]) -> list[int]:
        """:meth:`from_blocks`, returning each staged payload's checksum (of kind ``checksum``).

        On the CPU each object's CRC is taken right after its copy, while its payload
        is still in the core's cache; on the device path the sums are taken on the
        device and only they cross to the host.
        """
        if not self.use_memmove:
            self.from_blocks(slot, block_ids)
            return slot.payload_word_sums(range(len(block_ids)), self.object_bytes)
        self.check(block_ids)
        payload = ctypes.c_char * self.payload_bytes
        crcs = []
        for i, block in enumerate(block_ids):
            obj = slot.ptr + i * self.object_bytes
            self._block_into_object(block, obj)
            crcs.append(crc32c(payload.from_address(obj + HEADER_BYTES)))
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
        device = slot.tensor.device
        rows = device_index([i for i, _ in pairs], device)
        index = device_index([b for _, b in pairs], device)
        objects = slot.objects(max(i for i, _ in pairs) + 1, self.object_bytes).index_select(0, rows)
        for run, view in zip(self.runs, self._block_views()):
            view.index_copy_(0, index, objects[:, run.offset : run.offset + run.size])
        slot.synchronize()

    def to_blocks_if_intact(
        self, slot: StagingSlot, pairs: Sequence[tuple[int, int]], headers: Sequence[bytes]
    ) -> list[int]:
        """Like :meth:`to_blocks`, but a block whose payload is not as header ``headers[k]``
        states is reported: the positions ``k`` in ``pairs`` whose payload did not match the
        checksum its header states, of the kind it names.

        On the CPU a CRC-32C object is copied run by run and each run's CRC read back from
        the block right after its copy, from the core's cache (:meth:`into_block_checked`): a
        reported block is zeroed, holding nothing of the payload, and the caller fails it
        (vLLM recomputes it and never caches it, as for a direct load). A pass over the payload
        before the copy read it cold from memory: a third more time per load. Any other
        object, and every object on the device path, is checked in the buffer and copied
        only if it matches.
        """
        if not self.use_memmove:
            matches = slot.payloads_match([i for i, _ in pairs], headers, self.object_bytes)
            bad = [k for k, ok in enumerate(matches) if not ok]
            rejected = set(bad)
            self.to_blocks(slot, [pair for k, pair in enumerate(pairs) if k not in rejected])
            return bad
        self.check([b for _, b in pairs])
        bad = []
        for k, ((i, block), header) in enumerate(zip(pairs, headers, strict=True)):
            obj = slot.ptr + i * self.object_bytes
            if stated_checksum(header) is Checksum.CRC32C:
                if not self.into_block_checked(obj, block, header):
                    bad.append(k)
            elif slot.payload_matches_at(i, header, self.object_bytes):
                self._object_into_block(obj, block)
            else:
                bad.append(k)
        return bad

    # --- own segment -> blocks (direct loads, CPU) --------------------------------
    def into_block_checked(self, obj: int, block: int, header: bytes) -> bool:
        """Copy the object at address ``obj`` (in this process's memory) straight into
        ``block``, then check the block: whether its runs, read back from the block, have
        the CRC-32C ``header`` states. False: the check failed and the block was zeroed.

        A failed load's blocks go back to vLLM's free list, and a later request writes
        only the slots it computes: an object's random bytes left there (NaN, Inf) may
        reach a kernel that reads a whole block. A loader that left them gave wrong
        answers under corrupted objects (benchmarks/README.md, finding 17): a block that
        fails holds no byte of the object.

        Host memory only (``use_memmove``); ``header`` must state CRC-32C.
        """
        if not self.use_memmove or stated_checksum(header) is not Checksum.CRC32C:
            raise ValueError("a direct copy needs host blocks and a CRC-32C header")
        self.check([block])
        # Run by run: each run's CRC is read back from the block right after its copy, while
        # the run is still in the core's cache (the runs in the object's order, as saved).
        move, crc = ctypes.memmove, 0
        for run, run_type in zip(self.runs, self._run_types):
            at = run.base + block * run.block_stride
            move(at, obj + run.offset, run.size)
            crc = crc32c_extend(crc, run_type.from_address(at))
        if payload_matches(header, Checksum.CRC32C, crc):
            return True
        for run in self.runs:
            ctypes.memset(run.base + block * run.block_stride, 0, run.size)
        return False

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


def device_index(values: Sequence[int], device: Any) -> Any:
    """``values`` as an index tensor on ``device``, queued on the current stream: built in
    (pinned) host memory and copied without waiting. ``torch.tensor(..., device=...)`` would
    copy from pageable memory and wait for the stream, which on a save's stream is waiting
    for the step's forward: the host would wait for the device."""
    import torch

    host = torch.tensor(list(values), dtype=torch.long)
    if torch.device(device).type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class StagingSlot:
    """One registered staging buffer, on the device of the KV cache.

    ``device_path``: take the accelerator's code paths even in host memory (tests and
    benchmarks run them on CPU tensors).
    """

    def __init__(self, nbytes: int, device: Any, *, device_path: bool = False):
        import torch

        self._hold(torch.empty(nbytes, dtype=torch.uint8, device=device), device_path)

    def _hold(self, tensor: Any, device_path: bool) -> None:
        """Be the buffer of ``tensor`` (a 1-D byte tensor)."""
        self.tensor = tensor
        self.ptr = int(tensor.data_ptr())
        self.nbytes = int(tensor.numel())
        self.on_cpu = tensor.device.type == "cpu" and not device_path

    def part(self, offset: int, nbytes: int) -> StagingSlot:
        """Bytes ``offset..offset+nbytes`` of this buffer, as a buffer of its own (same registration)."""
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"part {offset}+{nbytes} outside a {self.nbytes}-byte buffer")
        part = StagingSlot.__new__(StagingSlot)
        part._hold(self.tensor[offset : offset + nbytes], not self.on_cpu)
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
        if not count:
            return []
        # One copy to the host of the headers only (``tolist``: a device-to-host copy of them).
        return [bytes(row) for row in self.objects(count, object_bytes)[:, :HEADER_BYTES].tolist()]

    def payload_crcs(self, indices: Sequence[int], object_bytes: int) -> list[int]:
        """The CRC-32C of the payload (the bytes after the header) of each object in ``indices``.

        On the device path the payloads are copied to the host: only for objects a CPU
        writer stored (their header names CRC-32C).
        """
        if self.on_cpu:
            view = ctypes.c_char * (object_bytes - HEADER_BYTES)
            start = self.ptr + HEADER_BYTES
            return [crc32c(view.from_address(start + i * object_bytes)) for i in indices]
        if not indices:
            return []
        host = self._payloads(indices, object_bytes).cpu().contiguous()
        return [crc32c(row.numpy()) for row in host]

    def payload_word_sums(self, indices: Sequence[int], object_bytes: int) -> list[int]:
        """The ``WORD_SUMS`` of the payload of each object in ``indices``, taken where the
        buffer is: 8 bytes an object cross to the host."""
        if not indices:
            return []
        return [int(v) for v in word_sums(self._payloads(indices, object_bytes)).tolist()]

    def payloads_match(
        self, indices: Sequence[int], headers: Sequence[bytes], object_bytes: int
    ) -> list[bool]:
        """Whether each object's payload has the checksum its header (``headers[k]``) states,
        of the kind it names: one pass per kind."""
        matches = [False] * len(indices)
        for kind, checksums in (
            (Checksum.WORD_SUMS, self.payload_word_sums),
            (Checksum.CRC32C, self.payload_crcs),
        ):
            ks = [k for k, header in enumerate(headers) if stated_checksum(header) is kind]
            values = checksums([indices[k] for k in ks], object_bytes)
            for k, value in zip(ks, values, strict=True):
                matches[k] = payload_matches(headers[k], kind, value)
        return matches

    def payload_matches_at(self, index: int, header: bytes, object_bytes: int) -> bool:
        """Whether object ``index``'s payload has the checksum ``header`` states (one object)."""
        kind = stated_checksum(header)
        if kind is Checksum.CRC32C:
            return payload_matches(header, kind, self.payload_crcs([index], object_bytes)[0])
        if kind is Checksum.WORD_SUMS:
            return payload_matches(header, kind, self.payload_word_sums([index], object_bytes)[0])
        return False

    def _payloads(self, indices: Sequence[int], object_bytes: int) -> Any:
        """The payloads of objects ``indices`` as a ``(len(indices), payload bytes)`` view
        (a gathered copy on the device when they are not ``0..n-1``)."""
        count = max(indices) + 1
        objects = self.objects(count, object_bytes)
        if list(indices) != list(range(count)):
            objects = objects.index_select(0, device_index(indices, self.tensor.device))
        return objects[:, HEADER_BYTES:]

    def synchronize(self) -> None:
        """Wait for this thread's device copies (nothing to wait for in host memory)."""
        if self.tensor.device.type == "cpu":
            return
        import torch

        torch.accelerator.current_stream(self.tensor.device).synchronize()
