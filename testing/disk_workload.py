"""A working set written through a pool client and read back: how many of its objects still hit.

Objects go through the connector's own put path (reserve, write, publish) and come
back through its load path (``get_into``); each object's bytes name its index, so a
read that returns another object's bytes counts as wrong, never as a hit. A write
the pool refuses for lack of memory (``store_full``: a disk tier that has not yet
written what fills the memory) is tried again until ``write_deadline_s``: the writer
keeps to the pace the pool takes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from kvpool.connector.pool_client import CODE_STORE_FULL, PoolClient, classify

RETRY_S = 0.05


@dataclass
class WorkloadResult:
    """What one pass of the working set came to."""

    objects: int
    object_bytes: int
    stored: int = 0  # published
    refusals: int = 0  # writes refused for lack of memory, then tried again
    not_stored: dict[str, int] = field(default_factory=dict)  # outcome -> objects never stored
    hits: int = 0  # read back whole, with their own bytes
    wrong: int = 0  # read back with other bytes (never expected)
    misses: dict[str, int] = field(default_factory=dict)  # outcome -> objects not read back
    missed: list[int] = field(default_factory=list)  # the indices of those objects
    hit_seconds: list[float] = field(default_factory=list)  # one load of one object each

    @property
    def hit_rate(self) -> float:
        return self.hits / self.objects if self.objects else 0.0


def _fill(buffer: np.ndarray, index: int) -> None:
    """Object ``index``'s bytes: its index, repeated (as little-endian 64-bit words)."""
    buffer.view(np.uint64)[:] = index


def write_and_read(
    client: PoolClient,
    keys: list[str],
    object_bytes: int,
    *,
    write_deadline_s: float = 60.0,
    retry_codes: tuple[int, ...] = (CODE_STORE_FULL,),
) -> WorkloadResult:
    """Store one object under each key (in order), then load each back (in the same order).

    A write refused with one of ``retry_codes`` is tried again (a tenant's writes past its
    quota: ``CODE_TENANT_QUOTA_EXCEEDED``, while the tier makes room in its memory).
    """
    if object_bytes % 8:
        raise ValueError("object_bytes must be a multiple of 8")
    result = WorkloadResult(len(keys), object_bytes)
    buffer = np.zeros(object_bytes, dtype=np.uint8)
    ptr = int(buffer.ctypes.data)
    client.register(ptr, object_bytes)
    try:
        deadline = time.monotonic() + write_deadline_s
        for index, key in enumerate(keys):
            _fill(buffer, index)
            while True:
                code = _put(client, key, ptr, object_bytes)
                if code not in retry_codes or time.monotonic() > deadline:
                    break
                result.refusals += 1
                time.sleep(RETRY_S)
            if code == 0:
                result.stored += 1
            else:
                outcome = classify(code).value
                result.not_stored[outcome] = result.not_stored.get(outcome, 0) + 1
        for index, key in enumerate(keys):
            buffer[:] = 0
            started = time.perf_counter()
            code = client.get_into([key], [[ptr]], [[object_bytes]])[0]
            took = time.perf_counter() - started
            outcome = classify(code, object_bytes)
            if outcome.value != "ok":
                result.misses[outcome.value] = result.misses.get(outcome.value, 0) + 1
                result.missed.append(index)
            elif np.all(buffer.view(np.uint64) == index):
                result.hits += 1
                result.hit_seconds.append(took)
            else:
                result.wrong += 1
    finally:
        client.unregister(ptr, object_bytes)
    return result


def _put(client: PoolClient, key: str, ptr: int, size: int) -> int:
    """Reserve, write and publish one object; 0 when published, else the first failing code."""
    code = client.reserve([key], [size])[0]
    if code != 0:
        return code
    written = client.write([key], [[ptr]], [[size]], [[0]])[0]
    if written != size:
        client.revoke([key])
        return written if written < 0 else -1
    return client.publish([key])[0]
