"""Shared fixtures: real services on free loopback ports, always stopped."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from testing.engine import apply_engine_env

# Before any test imports vLLM: a CPU engine in this process, no hub access.
apply_engine_env()
# vLLM may hash blocks with Python's hash(): every engine process of a run must agree.
os.environ.setdefault("PYTHONHASHSEED", "0")


@pytest.fixture(scope="session")
def local_pool() -> Iterator[object]:
    """A real Mooncake master and store process on loopback for the session."""
    from kvpool.connector.local.pool import LocalPool

    with LocalPool(segment_size="512MB") as pool:
        yield pool


@pytest.fixture
def cache_prefix() -> str:
    """A key namespace of its own for each test."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def pool_settings(local_pool, cache_prefix):
    from kvpool.connector.contract.settings import ConnectorSettings

    return ConnectorSettings.parse(
        {"master_server_address": local_pool.address, "cache_prefix": cache_prefix}
    )


@pytest.fixture
def pool_client(pool_settings) -> Iterator[object]:
    """A store client with no memory of its own (the store process holds it)."""
    from kvpool.connector.pool_client import open_client

    client = open_client(pool_settings, global_segment_size=0)
    yield client
    client.close()
