"""The Mooncake client wrapper against a real master: batching and outages."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.local.pool import LocalPool
from kvpool.connector.pool_client import CODE_RPC_FAILED, open_client
from testing.pool_store import put_from, raw_store, replace_raw_store

pytestmark = pytest.mark.mooncake


class CountingStore:
    """The real store client, counting the calls that reach it."""

    def __init__(self, store: object):
        self._store = store
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._store, name)
        if callable(attr):

            def counted(*args: object, **kwargs: object) -> object:
                self.calls.append(name)
                return attr(*args, **kwargs)

            return counted
        return attr


def test_a_dead_master_makes_transfers_fail_fast() -> None:
    pool = LocalPool(segment_size="32MB").start()
    try:
        assert pool.master is not None
        client = open_client(
            ConnectorSettings.parse({"master_server_address": pool.address}), global_segment_size=0
        )
        try:
            buf = np.zeros(4096, dtype=np.uint8)
            client.register(buf.ctypes.data, buf.nbytes)
            assert put_from(client, ["a"], [[buf.ctypes.data]], [[64]]) == [0]
            spy = CountingStore(raw_store(client))
            replace_raw_store(client, spy)
            pool.master.kill()
            # Batches in a row wait out their RPC timeout and fail...
            assert put_from(client, ["b"], [[buf.ctypes.data]], [[64]]) == [CODE_RPC_FAILED]
            assert not client.unreachable  # one failed batch may be a partial failure
            assert put_from(client, ["b"], [[buf.ctypes.data]], [[64]]) == [CODE_RPC_FAILED]
            assert client.unreachable
            reached = len(spy.calls)
            # ...then, for a moment, nothing is sent: loads, saves and lookups fail at once.
            assert client.get_into(["a"], [[buf.ctypes.data]], [[64]]) == [CODE_RPC_FAILED]
            assert put_from(client, ["c"], [[buf.ctypes.data]], [[64]]) == [CODE_RPC_FAILED]
            assert client.presence(["a"]) == ([False], "rpc_failed")
            assert len(spy.calls) == reached
        finally:
            client.close()
    finally:
        pool.stop()
        for part in (pool.master, pool.store):  # the pool keeps them: this test killed its master
            if part is not None:
                shutil.rmtree(part.log_dir, ignore_errors=True)


def test_batches_stay_within_the_bound(pool_client) -> None:
    spy = CountingStore(raw_store(pool_client))
    replace_raw_store(pool_client, spy)
    keys = [f"bound-{i}" for i in range(2 * pool_client.batch_size + 1)]
    buf = np.zeros(64, dtype=np.uint8)
    pool_client.register(buf.ctypes.data, buf.nbytes)
    codes = put_from(pool_client, keys, [[buf.ctypes.data]] * len(keys), [[16]] * len(keys))
    assert codes == [0] * len(keys)
    assert spy.calls.count("batch_put_from_multi_buffers") == 3
    assert pool_client.exists(keys) == [True] * len(keys)
    assert spy.calls.count("batch_is_exist") == 1


def test_calls_stay_within_the_buffer_bound(pool_client) -> None:
    """Each key gathers many buffers (one per layer and K/V): calls are cut by buffers too."""
    from kvpool.connector.pool_client import MAX_BATCH_ENTRIES

    spy = CountingStore(raw_store(pool_client))
    replace_raw_store(pool_client, spy)
    buf = np.arange(64 * 8, dtype=np.uint8)
    pool_client.register(buf.ctypes.data, buf.nbytes)
    per_key = 12  # e.g. 6 layers x (K, V)
    keys = [f"entries-{i}" for i in range(200)]
    ptrs = [[buf.ctypes.data + 8 * j for j in range(per_key)] for _ in keys]
    sizes = [[8] * per_key for _ in keys]
    assert put_from(pool_client, keys, ptrs, sizes) == [0] * len(keys)
    calls = spy.calls.count("batch_put_from_multi_buffers")
    assert calls == -(-len(keys) * per_key // (MAX_BATCH_ENTRIES // per_key * per_key))
    out = np.zeros_like(buf)
    pool_client.register(out.ctypes.data, out.nbytes)
    got = pool_client.get_into(keys[:1], [[out.ctypes.data + 8 * j for j in range(per_key)]], sizes[:1])
    assert got == [8 * per_key] and np.array_equal(out[: 8 * per_key], buf[: 8 * per_key])


def test_a_read_answered_with_fewer_codes_than_keys_moves_none(pool_client) -> None:
    """Every block a read asked for needs its own code: a short answer counts none as loaded."""
    buf = np.arange(64, dtype=np.uint8)
    pool_client.register(buf.ctypes.data, buf.nbytes)
    keys = ["short-0", "short-1"]
    assert put_from(pool_client, keys, [[buf.ctypes.data]] * 2, [[16]] * 2) == [0, 0]

    class ShortAnswers(CountingStore):
        def batch_get_into_multi_buffers(self, *args: object) -> list[int]:
            return list(raw.batch_get_into_multi_buffers(*args))[:1]

    raw = raw_store(pool_client)
    replace_raw_store(pool_client, ShortAnswers(raw))
    out = np.zeros(32, dtype=np.uint8)
    pool_client.register(out.ctypes.data, out.nbytes)
    got = pool_client.get_into(keys, [[out.ctypes.data], [out.ctypes.data + 16]], [[16], [16]])
    assert got == [CODE_RPC_FAILED, CODE_RPC_FAILED]


def test_every_code_mooncake_answers_for_a_replica_gone_is_named() -> None:
    """A store that died under a read leaves objects the master lists with no readable copy
    (REPLICA_IS_NOT_READY, seen in the chaos run): a reason of its own, not other_error."""
    from kvpool.connector.pool_client import FAILURE_OUTCOMES, Outcome, classify

    assert [classify(code) for code in (-703, -710, -712)] == [Outcome.REPLICA_UNAVAILABLE] * 3
    assert classify(-707) is Outcome.TRANSFER_FAILED, "a read whose lease ran out: bytes untrusted"
    assert Outcome.REPLICA_UNAVAILABLE in FAILURE_OUTCOMES
    assert classify(-12345) is Outcome.OTHER


def test_a_put_session_left_behind_is_revoked_and_reserved_again(pool_client) -> None:
    """Mooncake refuses (-600) a reservation of a key its client still holds a put session for:
    one a save left behind (after a master failover, the reservation made on the old leader
    lingers until revoked: benchmarks/README.md, table 10) is revoked and reserved again; one a
    save of this client holds now is another writer's reservation (``in_flight``)."""
    from kvpool.connector.pool_client import CODE_RESERVED_ELSEWHERE, CODE_SESSION_HELD

    store = raw_store(pool_client)
    assert store.batch_put_session_start(["left"], [64]) == [0]  # behind the client's back
    assert store.batch_put_session_start(["left"], [64]) == [CODE_SESSION_HELD]
    assert pool_client.reserve(["left"], [64]) == [0], "revoked, then reserved again"
    assert pool_client.reserve(["left"], [64]) == [CODE_RESERVED_ELSEWHERE], "a save here holds it"
    assert pool_client.revoke(["left"]) == [0]
    assert pool_client.reserve(["left"], [64]) == [0]
    assert pool_client.revoke(["left"]) == [0]
    assert pool_client.exists(["left"]) == [False], "nothing of it ever visible"


def test_a_put_session_mooncake_keeps_is_another_writers_reservation(
    pool_client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session left behind whose revoke the master refuses stays in Mooncake's client for a
    retry, and every reservation of its key answers -600 (seen in a chaos run after a store
    restarted under saves: counted ``other_error``). It is a reservation no one publishes,
    as another writer's (``in_flight``); once the master lets it go, the key is reserved again."""
    from kvpool.connector.pool_client import CODE_RESERVED_ELSEWHERE, Outcome, classify
    from testing.mooncake_faults import mooncake_store_class

    store = raw_store(pool_client)
    assert store.batch_put_session_start(["kept"], [64]) == [0]  # behind the client's back
    refused = -702  # INVALID_REPLICA: a revoke the master refuses; Mooncake keeps the session
    monkeypatch.setattr(
        mooncake_store_class(), "batch_put_session_revoke", lambda _, keys: [refused] * len(keys)
    )
    assert pool_client.reserve(["kept"], [64]) == [CODE_RESERVED_ELSEWHERE]
    assert classify(CODE_RESERVED_ELSEWHERE) is Outcome.IN_FLIGHT
    monkeypatch.undo()
    assert pool_client.reserve(["kept"], [64]) == [0], "revoked now, then reserved again"
    assert pool_client.revoke(["kept"]) == [0]
    assert pool_client.exists(["kept"]) == [False], "nothing of it ever visible"
