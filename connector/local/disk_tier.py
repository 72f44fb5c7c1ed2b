"""A local disk tier under a store's memory: Mooncake's SSD offload, set up for one store.

With the tier, the master runs with ``--enable_offload`` and the store process
(``mooncake_client --enable_offload``) writes each object it holds to files in a
directory of its own (Mooncake's bucket backend); when the master evicts an object's
memory copy, reads are served from that file by the store's offload RPC server, for
clients with or without memory of their own. docs/tenancy.md says what was measured.

The directory is made when the store starts and removed with everything in it when
the store stops: :meth:`DiskTier.prepare` and :meth:`DiskTier.remove`.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

EVICTION_POLICIES = ("none", "fifo", "lru")
EvictionPolicy = Literal["none", "fifo", "lru"]

#: Seconds between a store's offload heartbeats: it fetches the objects to write to disk
#: and writes them then (Mooncake's default is 10 s; until an object is on disk its
#: memory cannot be evicted, so writes beyond memory are refused meanwhile).
HEARTBEAT_S = 1
#: The master's read lease with the tier (Mooncake's default 10 s): a lookup or read of
#: an object keeps its memory from eviction this long, and so keeps the tier from
#: freeing memory. Loads check every object's header and payload, so a read that
#: outlives its lease and meets reused memory is a miss, never a wrong block.
LEASE_TTL_MS = 1000


@dataclass
class DiskTier:
    """Options of one store's disk tier (sizes in bytes), named as Mooncake names them."""

    capacity: int  # MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES, the bucket backend's quota too
    parent: Path | None = None  # where the tier's own directory is made (None: the temp dir)
    key_limit: int = 1_000_000  # MOONCAKE_OFFLOAD_TOTAL_KEYS_LIMIT
    eviction: EvictionPolicy = "lru"  # MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY
    high_watermark: float = 0.9  # MOONCAKE_OFFLOAD_DISK_EVICTION_HIGH_WATERMARK_RATIO
    low_watermark: float = 0.8  # MOONCAKE_OFFLOAD_DISK_EVICTION_LOW_WATERMARK_RATIO
    # Objects per bucket file. The store writes a bucket once this many objects (or
    # bucket_bytes) wait for one; those left waiting at a heartbeat are reported to the
    # master as not offloaded, their memory copies become evictable, and under memory
    # pressure they are lost before their bucket is written (docs/tenancy.md: 10-17 of
    # 96 objects lost with 8-object buckets). One object a bucket leaves none waiting.
    bucket_keys: int = 1  # MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT (Mooncake's default 500)
    bucket_bytes: int = 8 << 20  # MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES (default 256 MiB)
    lease_ttl_ms: int = LEASE_TTL_MS
    directory: Path | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(f"{name}: {rule}" for name, rule in problems.items()))

    def problems(self) -> dict[str, str]:
        """Each option that breaks its rule, with the rule."""
        out: dict[str, str] = {}
        if self.capacity < (1 << 20):
            out["capacity"] = "at least 1 MiB"
        if self.key_limit < 1:
            out["key_limit"] = "at least 1 object"
        if self.eviction not in EVICTION_POLICIES:
            out["eviction"] = f"one of {', '.join(EVICTION_POLICIES)}"
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            out["watermarks"] = "0 < low watermark < high watermark <= 1"
        if self.bucket_keys < 1:
            out["bucket_keys"] = "at least 1 object"
        if not (1 << 10) <= self.bucket_bytes <= self.capacity:
            out["bucket_bytes"] = "at least 1 KiB and at most the capacity"
        if self.lease_ttl_ms < 1:
            out["lease_ttl_ms"] = "at least 1 ms"
        if self.parent is not None and not self.parent.is_dir():
            out["parent"] = f"{self.parent} is not a directory"
        return out

    def prepare(self) -> Path:
        """Make the tier's own directory (its parent stays as it was) and return it."""
        if self.directory is None:
            parent = None if self.parent is None else str(self.parent.resolve())
            self.directory = Path(tempfile.mkdtemp(prefix="kvpool-disk-", dir=parent)).resolve()
        return self.directory

    def remove(self) -> None:
        """Remove the tier's directory and every file Mooncake wrote in it."""
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def master_args(self) -> tuple[str, ...]:
        """The master's flags for a pool whose stores have a disk tier."""
        return ("--enable_offload=true", f"--default_kv_lease_ttl={self.lease_ttl_ms}")

    def store_args(self) -> tuple[str, ...]:
        return ("--enable_offload=true",)

    def store_env(self) -> dict[str, str]:
        """The store process's Mooncake offload variables (after :meth:`prepare`)."""
        return self.offload_env(str(self.prepare()))

    def offload_env(self, directory: str) -> dict[str, str]:
        """The Mooncake offload variables of a store whose tier is ``directory`` (pure: the
        operator renders them for store pods whose tier is a mounted volume)."""
        return {
            "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": directory,
            "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": "bucket_storage_backend",
            "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": str(self.capacity),
            "MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE": str(self.capacity),
            "MOONCAKE_OFFLOAD_TOTAL_KEYS_LIMIT": str(self.key_limit),
            "MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY": self.eviction,
            "MOONCAKE_OFFLOAD_ENABLE_DISK_WATERMARK_EVICTION": "true" if self.eviction != "none" else "false",
            "MOONCAKE_OFFLOAD_DISK_EVICTION_HIGH_WATERMARK_RATIO": str(self.high_watermark),
            "MOONCAKE_OFFLOAD_DISK_EVICTION_LOW_WATERMARK_RATIO": str(self.low_watermark),
            "MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT": str(self.bucket_keys),
            "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES": str(self.bucket_bytes),
            "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": str(HEARTBEAT_S),
            # The staging buffer the store reads files into for others: a bucket at least.
            "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": str(max(self.bucket_bytes, 64 << 20)),
        }

    def usage_bytes(self) -> int:
        """Bytes of the files in the tier's directory now."""
        if self.directory is None or not self.directory.exists():
            return 0
        return sum(p.stat().st_size for p in self.directory.rglob("*") if p.is_file())
