"""The benchmark's Mooncake pool: one local master + store per run, clients on it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from testing.pool_store import raw_store

PUT_CHUNK = 500


def settings(address: str, cache_prefix: str, **extra: Any) -> Any:
    from kvpool.connector.contract.settings import ConnectorSettings

    return ConnectorSettings.parse({"master_server_address": address, "cache_prefix": cache_prefix, **extra})


def client(address: str, cache_prefix: str = "bench", **extra: Any) -> Any:
    """A ``PoolClient`` contributing no memory (the pool's store process holds it)."""
    from kvpool.connector.pool_client import open_client

    return open_client(settings(address, cache_prefix, **extra), global_segment_size=0)


def put_markers(pool_client: Any, keys: Sequence[str], value: bytes = b"kv" * 8) -> None:
    """Store a small value under every key (lookups only ask whether keys exist)."""
    store = raw_store(pool_client)
    for start in range(0, len(keys), PUT_CHUNK):
        part = list(keys[start : start + PUT_CHUNK])
        code = store.put_batch(part, [value] * len(part))
        if code != 0:
            raise RuntimeError(f"put_batch of {len(part)} keys failed with {code}")
