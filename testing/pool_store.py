"""The Mooncake store under a connector's pool client, for tests that act on the pool itself.

Tests replace objects (``upsert``), read them back byte for byte, or wrap the store to count
calls; this is the one place that reaches under :class:`PoolClient` to do so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.pool_client import PoolClient, open_client


@contextlib.contextmanager
def bare_client(master_address: str) -> Iterator[PoolClient]:
    """A client of the pool at ``master_address`` that contributes no memory; closed after."""
    settings = ConnectorSettings.parse({"master_server_address": master_address})
    client = open_client(settings, global_segment_size=0)
    try:
        yield client
    finally:
        client.close()


def raw_store(client: PoolClient) -> Any:
    """The ``MooncakeDistributedStore`` the client calls."""
    return client._store


def replace_raw_store(client: PoolClient, store: Any) -> None:
    """Make the client call ``store`` (a wrapper of its own store) from now on."""
    client._store = store


def put_bytes(client: PoolClient, key: str, value: bytes) -> int:
    """Store ``value`` under ``key`` with Mooncake's plain ``put`` (an existing key keeps its value)."""
    return int(raw_store(client).put(key, value))


def put_on(client: PoolClient, key: str, value: bytes, segment: str | None = None) -> int:
    """``put_bytes``, with the object placed on ``segment`` (a store's) when given."""
    from mooncake.store import ReplicateConfig

    config = ReplicateConfig()
    if segment is not None:
        config.preferred_segment = segment
    return int(raw_store(client).put(key, value, config))


def put_from(
    client: PoolClient, keys: Sequence[str], ptrs: Sequence[list[int]], sizes: Sequence[list[int]]
) -> list[int]:
    """Write each key from its gather list through the client's bounded batches; per-key codes."""
    return client._batched(raw_store(client).batch_put_from_multi_buffers, keys, ptrs, sizes)


def put_placement(client: PoolClient) -> tuple[Any, ...]:
    """The extra arguments of the client's puts that place objects where its saves go (its own
    segment, if it has one): empty when Mooncake chooses."""
    config = client._put_config
    return () if config is None else (config,)
