"""vLLM's reset in the pool, on a real Mooncake master and store: this layout's keys go, no other.

How vLLM 0.32 calls it (``POST /reset_prefix_cache?reset_external=true`` on a real
server) is in ``tests/connector/local/test_serving_local_pool.py``.
"""

from __future__ import annotations

import time

import pytest

from kvpool.connector.contract.keys import KeySpace
from kvpool.connector.scheduler.pool_reset import LayoutReset, layout_pattern
from testing.pool_store import put_bytes

pytestmark = pytest.mark.mooncake

WAIT_S = 60.0  # bound on waiting for the sweep (Mooncake's lease is seconds)


def _put(client, keys: list[str]) -> None:
    for key in keys:
        assert put_bytes(client, key, b"kv") == 0


def _present(client, keys: list[str]) -> list[str]:
    return [k for k, ok in zip(keys, client.exists(keys)) if ok]


def test_pattern_names_only_its_prefix_and_layout() -> None:
    assert layout_pattern(KeySpace("team.a", "0123456789abcdef")) == "^team\\.a/0123456789abcdef/"


def test_reset_removes_this_layout_and_nothing_else(pool_client, cache_prefix) -> None:
    ours = KeySpace(f"{cache_prefix}.x", "aaaaaaaaaaaaaaaa")
    mine = [ours.key(g, 0, 0, f"d{i}") for g in range(2) for i in range(3)]
    others = [
        KeySpace(f"{cache_prefix}.x", "bbbbbbbbbbbbbbbb").key(0, 0, 0, "d0"),  # another layout
        KeySpace(f"{cache_prefix}Zx", "aaaaaaaaaaaaaaaa").key(0, 0, 0, "d0"),  # '.' is not a wildcard
        KeySpace(f"{cache_prefix}.xy", "aaaaaaaaaaaaaaaa").key(0, 0, 0, "d0"),  # a longer prefix
        f"other/{cache_prefix}.x/aaaaaaaaaaaaaaaa/d0",  # the pattern is anchored
    ]
    _put(pool_client, mine + others)
    reset = LayoutReset(pool_client, ours, sweep_s=0.0)
    try:
        assert reset.reset()
        assert _present(pool_client, mine) == []
        assert _present(pool_client, others) == others
    finally:
        reset.close()
        pool_client.remove(others)


def test_keys_a_lookup_holds_are_removed_once_released(local_pool, pool_client, cache_prefix) -> None:
    """Mooncake keeps an object a lookup just leased; the background sweep removes it after."""
    ours = KeySpace(cache_prefix, "cccccccccccccccc")
    held, free = ours.key(0, 0, 0, "held"), ours.key(0, 0, 0, "free")
    _put(pool_client, [held, free])
    assert pool_client.exists([held]) == [True]  # a lookup: Mooncake leases the object
    keys_before = _key_count(local_pool)
    reset = LayoutReset(pool_client, ours, sweep_s=WAIT_S)
    try:
        assert reset.reset()
        # The free key went at once; the held one stays until its lease ends.
        assert _key_count(local_pool) == keys_before - 1
        deadline = time.monotonic() + WAIT_S
        while _key_count(local_pool) > keys_before - 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _key_count(local_pool) == keys_before - 2
    finally:
        reset.close()


def _key_count(pool) -> int:
    """Keys the master holds, from its metrics (asking leases nothing)."""
    for line in pool.master.metrics().splitlines():
        if line.startswith("master_key_count "):
            return int(float(line.split()[1]))
    raise AssertionError("master_key_count not exported")
