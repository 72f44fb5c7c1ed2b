"""A client that contributes memory keeps what it saves in its own segment.

Co-located deployments (the operator's embedded mode: every vLLM rank contributes
a segment) then load their own saves by memcpy instead of over the network; other
clients read those objects as they read any store's. Real Mooncake master and
store on loopback; where an object lives is read from Mooncake's replica
descriptors (the transport endpoint of the segment holding it).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.connector.pool_client import open_client
from testing.pool_store import raw_store

pytestmark = pytest.mark.mooncake

OBJECTS = 16
SIZE = 4096


@pytest.fixture(scope="module")
def own_pool_settings():
    """A pool of its own: no other test's client has a segment mounted in it."""
    from kvpool.connector.contract.settings import ConnectorSettings
    from kvpool.connector.local.pool import LocalPool

    with LocalPool(segment_size="64MB") as pool:
        yield ConnectorSettings.parse({"master_server_address": pool.address, "cache_prefix": "local"})


def _store(client, keys: list[str], payload: np.ndarray) -> None:
    client.register(payload.ctypes.data, payload.nbytes)
    assert client.reserve(keys, [SIZE] * len(keys)) == [0] * len(keys)
    ptrs = [[payload.ctypes.data + i * SIZE] for i in range(len(keys))]
    assert client.write(keys, ptrs, [[SIZE]] * len(keys), [[0]] * len(keys)) == [SIZE] * len(keys)
    assert client.publish(keys) == [0] * len(keys)


def _endpoints(client, keys: list[str]) -> set[str]:
    held = raw_store(client).batch_get_replica_desc(keys)
    return {
        replica.get_memory_descriptor().buffer_descriptor.transport_endpoint
        for key in keys
        for replica in held[key]
    }


def test_saves_land_in_the_contributing_clients_segment(own_pool_settings) -> None:
    pool_settings = own_pool_settings
    reader = open_client(pool_settings, global_segment_size=0)
    own = None
    try:
        rng = np.random.default_rng(0)
        mine = rng.integers(0, 255, OBJECTS * SIZE, dtype=np.uint8)
        theirs = rng.integers(0, 255, OBJECTS * SIZE, dtype=np.uint8)
        own_keys = [f"{pool_settings.cache_prefix}/own/{i}" for i in range(OBJECTS)]
        store_keys = [f"{pool_settings.cache_prefix}/store/{i}" for i in range(OBJECTS)]
        # Before the contributing client mounts its segment, the store process holds everything.
        _store(reader, store_keys, theirs)
        store_segment = _endpoints(reader, store_keys)
        own = open_client(pool_settings, global_segment_size=64 << 20)
        _store(own, own_keys, mine)
        own_segment = _endpoints(own, own_keys)
        assert len(store_segment) == 1 and len(own_segment) == 1
        assert own_segment != store_segment  # every save of the contributing client is its own
        # Any client reads them, byte for byte.
        back = np.zeros_like(mine)
        reader.register(back.ctypes.data, back.nbytes)
        ptrs = [[back.ctypes.data + i * SIZE] for i in range(OBJECTS)]
        assert reader.get_into(own_keys, ptrs, [[SIZE]] * OBJECTS) == [SIZE] * OBJECTS
        assert bytes(back) == bytes(mine)
    finally:
        if own is not None:
            own.close()
        reader.close()
