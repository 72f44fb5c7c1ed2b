"""One master, one store, one real engine: the master and the store fail under it.

The master lives on fixed loopback ports, so a killed master can be restarted where its
clients (the engine's connector, the store process) reconnect. The engine's connector
uses ``batch_size=4``: every transfer of a prefix spans several bounded batches.

Each test: no request hangs (every ``serve`` has a deadline), every output equals its
reference, the pool is empty after a restart and refills, hits resume, and each kind of
failure is counted both in the worker's records and in vLLM's ``vllm:kvpool_failures``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.local.pool import wait_for_capacity
from kvpool.connector.pool_client import PoolClient, open_client
from testing.engine import transfer_config
from testing.mooncake_faults import READ_METHOD, mooncake_store_class
from testing.pool_store import put_bytes
from testing.worker import before_each_load, before_each_save
from tests.faults.helpers import (
    PREFIX_TOKENS,
    Engine,
    SinglePool,
    check_outputs,
    failures_by_reason,
    outlast_fail_fast,
    serve_until_hits,
)

pytestmark = [pytest.mark.faults, pytest.mark.engine, pytest.mark.mooncake, pytest.mark.timeout(240)]

BATCH = 4
RESTART_AFTER_S = 1.0
NO_EVICTION = ("--eviction_high_watermark_ratio=1.0", "--default_kv_lease_ttl=60000")
STORE_PAUSE_S = 0.05  # a read of the short-lease test waits this long for the store
SMALL_STORE = "16MB"  # the smallest segment mooncake_client accepts


@pytest.fixture(scope="module")
def pool() -> Iterator[SinglePool]:
    pool = SinglePool().start()
    try:
        yield pool
    finally:
        pool.stop()


@pytest.fixture(scope="module")
def engine(gemma_dir: Path, references: dict, pool: SinglePool) -> Iterator[Engine]:
    settings = ConnectorSettings.parse(
        {"master_server_address": pool.address, "cache_prefix": "single", "batch_size": BATCH}
    )
    engine = Engine(gemma_dir, transfer_config(settings), log_stats=True)
    try:
        yield engine
    finally:
        engine.close()


@dataclass
class Window:
    """What the engine recorded since a test began."""

    engine: Engine
    transfers_at: int
    lookups_at: int
    series_at: Counter[str]

    def mark(self) -> int:
        return len(self.engine.transfers())

    def transfers(self, operation: str | None = None, since: int | None = None) -> list[Any]:
        out = self.engine.transfers()[self.transfers_at if since is None else since :]
        return [t for t in out if operation is None or t.operation == operation]

    def failures(self, operation: str | None = None) -> Counter[str]:
        return failures_by_reason(self.transfers(operation))

    def series(self) -> Counter[str]:
        return self.engine.failure_series() - self.series_at

    def lookup_failures(self) -> Counter[str]:
        """Lookups whose existence check the master could not answer (after a restart, the
        client's first ask may fail): the series counts them too."""
        return failures_by_reason(self.engine.lookups()[self.lookups_at :])

    def check_counted(self) -> Counter[str]:
        """Records and metrics agree on every failure, by reason; returns the transfers'."""
        undrained = self.engine.undrained_failures()
        failures = self.failures()
        lookups = self.lookup_failures()
        assert set(lookups) <= {"rpc_failed", "timeout"}, lookups
        assert self.series() == failures + lookups - undrained
        return failures


@pytest.fixture
def window(pool: SinglePool, engine: Engine) -> Window:
    """A healthy, empty pool (256MB store, default master) and a mark in the engine's records
    (an earlier test's saves still in flight end first: they would land in this one's window)."""
    engine.wait_for_saves()
    store = pool.store
    if (
        store is None
        or store.process is None
        or store.process.poll() is not None
        or store.segment_size != "256MB"
    ):
        if store is not None:
            store.kill()
        pool.restart_master()
        pool.start_store("256MB")
    else:
        pool.restart_master()
    assert pool.key_count() == 0
    return Window(engine, len(engine.transfers()), len(engine.lookups()), engine.failure_series())


class Restarter:
    """Kills the master once, from inside the connector, and restarts it a moment later."""

    def __init__(self, pool: SinglePool, *args: str):
        self.pool = pool
        self.args = args
        self.killed_at: float | None = None
        self.restarted_at: float | None = None
        self._thread: threading.Thread | None = None

    def fire(self) -> None:
        if self.killed_at is not None:
            return
        self.pool.kill_master()
        self.killed_at = time.monotonic()
        self._thread = threading.Thread(target=self._restart, name="restart-master")
        self._thread.start()

    def _restart(self) -> None:
        time.sleep(RESTART_AFTER_S)
        self.pool.start_master(*self.args)
        self.restarted_at = time.monotonic()

    def join(self) -> None:
        assert self._thread is not None, "the fault never fired"
        self._thread.join(60)
        assert self.restarted_at is not None, "the master was not restarted"
        assert self.pool.master is not None
        wait_for_capacity(self.pool.master, 60)


def test_master_killed_and_restarted_mid_load(
    pool: SinglePool, engine: Engine, window: Window, references: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    warm = [engine.serve(k) for k in [(0, 0), (1, 0), (0, 1)]]
    assert [s.cached for s in warm] == [0, 0, PREFIX_TOKENS]
    assert engine.stored_prefix_keys((1, 0)) > 0

    fault = Restarter(pool)
    before_each_load(monkeypatch, fault.fire)
    mark = window.mark()
    faulted = engine.serve((0, 2))
    monkeypatch.undo()
    fault.join()
    outlast_fail_fast()

    # The restarted master is empty: nothing stored before the fault is offered again.
    assert engine.stored_prefix_keys((1, 0)) == 0
    refill = serve_until_hits(engine, [(1, 1), (1, 2), (1, 3), (1, 0)])
    check_outputs([*warm, faulted, *refill], references)
    assert refill[0].cached == 0 and refill[-1].hit, "the pool refilled and hits resumed"

    (load, *later) = window.transfers("load", since=mark)
    assert load.failures and load.recomputed, "the failed load sent its request to recompute"
    # A call to the dead or restarting master fails, or passes the load's deadline on a
    # loaded machine (a timeout): each ends in bounded time and recomputes.
    assert set(load.failures) <= {"rpc_failed", "missing", "timeout"}
    assert all(not t.failures for t in later)
    failures = window.check_counted()
    assert failures["rpc_failed"] + failures["missing"] + failures["timeout"] >= sum(load.failures.values())
    print(
        f"mid-load restart: failed load {dict(load.failures)}, faulted request {faulted.seconds:.2f}s, "
        f"no hits for {refill[-1].finished - fault.killed_at:.2f}s, failures {dict(failures)}"
    )


def test_master_killed_and_restarted_mid_save(
    pool: SinglePool, engine: Engine, window: Window, references: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    warm = [engine.serve(k) for k in [(1, 0), (1, 1)]]
    assert warm[1].hit

    fault = Restarter(pool)
    before_each_save(monkeypatch, fault.fire)
    faulted = engine.serve((2, 0))
    monkeypatch.undo()
    fault.join()
    outlast_fail_fast()

    assert engine.stored_prefix_keys((1, 0)) == 0
    refill = serve_until_hits(engine, [(2, 1), (2, 2), (2, 3), (2, 0)])
    check_outputs([*warm, faulted, *refill], references)
    assert refill[-1].hit, "the pool refilled and hits resumed"
    failures = window.check_counted()
    assert set(failures) <= {"rpc_failed", "store_full", "timeout"}
    print(
        f"mid-save restart: faulted request {faulted.seconds:.2f}s, "
        f"no hits for {refill[-1].finished - fault.killed_at:.2f}s, failures {dict(failures)}"
    )


def test_store_process_lost(
    pool: SinglePool, engine: Engine, window: Window, references: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    warm = [engine.serve(k) for k in [(3, 0), (3, 1)]]
    assert warm[1].hit
    lost: dict[str, float] = {}

    def kill_store_once() -> None:
        if not lost:
            pool.kill_store()
            lost["at"] = time.monotonic()

    before_each_load(monkeypatch, kill_store_once)
    mark = window.mark()
    faulted = engine.serve((3, 2))
    monkeypatch.undo()
    assert lost, "a load ran"
    # Without a store: every request completes, none is served from the pool.
    orphaned = [engine.serve(k) for k in [(3, 3), (0, 0), (0, 1)]]
    assert not any(s.hit for s in orphaned[1:])

    pool.start_store()
    replaced_at = time.monotonic()
    refill = serve_until_hits(engine, [(0, 2), (0, 3), (0, 0), (0, 1)])
    check_outputs([*warm, faulted, *orphaned, *refill], references)
    assert refill[-1].hit, "hits resumed on the new store"

    first_load = window.transfers("load", since=mark)[0]
    assert first_load.failures and first_load.recomputed
    failures = window.check_counted()
    assert failures["transfer_failed"] > 0, "reads from the dead store failed as transfers"
    assert set(failures) <= {"transfer_failed", "store_full", "missing", "rpc_failed", "timeout"}
    print(
        f"store lost: faulted request {faulted.seconds:.2f}s, new store after "
        f"{replaced_at - lost['at']:.2f}s, no hits for {refill[-1].finished - lost['at']:.2f}s, "
        f"failures {dict(failures)}"
    )


def _fill(client: PoolClient, prefix: str) -> list[str]:
    """Put junk until the pool refuses it (-200), big objects first; the keys stored, each
    leased as it is stored.

    The put the pool refuses wakes the master's eviction, which takes objects without a
    lease: asking whether each object exists right after its put leases it (60 s here), so
    the first puts cannot be evicted by the refusal that follows them."""
    keys: list[str] = []
    for size in (1 << 20, 32 << 10, 4 << 10):
        for index in range(600):
            key = f"{prefix}-{size}-{index}"
            code = put_bytes(client, key, b"\0" * size)
            if code != 0:
                assert code == -200, f"junk put failed with {code}"
                break
            assert client.exists([key]) == [True], f"{key} not found right after its put"
            keys.append(key)
    return keys


def test_store_full(
    pool: SinglePool, engine: Engine, window: Window, references: dict, tmp_path: Path
) -> None:
    """A full store that cannot evict answers -200: saves fail as store_full, nothing else."""
    pool.kill_store()
    pool.restart_master(*NO_EVICTION)
    pool.start_store(SMALL_STORE)
    client = open_client(
        ConnectorSettings.parse({"master_server_address": pool.address}), global_segment_size=0
    )
    try:
        junk = _fill(client, "junk")
        # Each junk object was leased as it was stored (60s here): none can be evicted.
        assert all(client.exists(junk))
        assert put_bytes(client, "one-more", b"\0" * (32 << 10)) == -200
        full = [engine.serve(k) for k in [(2, 0), (2, 1), (2, 2)]]
        assert not any(s.hit for s in full), "nothing could be stored, so nothing hits"
        saves = window.failures("save")
        assert saves["store_full"] > 0 and set(saves) == {"store_full"}
        # Room again: the same stream is stored and served.
        client.remove(junk)
        refill = serve_until_hits(engine, [(2, 3), (2, 0), (2, 1)])
    finally:
        client.close()
    check_outputs([*full, *refill], references)
    assert refill[-1].hit
    failures = window.check_counted()
    assert set(failures) == {"store_full"}
    print(f"store full: {len(junk)} junk objects, failures {dict(failures)}")


def test_store_full_evicts(pool: SinglePool, engine: Engine, window: Window, references: dict) -> None:
    """A full store that may evict makes room: saves succeed and hits continue."""
    pool.kill_store()
    pool.restart_master()
    pool.start_store(SMALL_STORE)
    client = open_client(
        ConnectorSettings.parse({"master_server_address": pool.address}), global_segment_size=0
    )
    try:
        junk = [f"junk-{i}" for i in range(640)]  # 20MB of 32KB objects into 16MB: eviction
        codes = Counter(put_bytes(client, key, b"\0" * (32 << 10)) for key in junk)
        assert codes[0] > 400
        served = serve_until_hits(engine, [(3, 0), (3, 1), (3, 2), (3, 3)], hits=2)
        present = sum(client.exists(junk))
    finally:
        client.close()
    check_outputs(served, references)
    assert sum(s.hit for s in served) >= 2, "saves made room by evicting junk"
    assert present < codes[0], "the master evicted junk"
    failures = window.check_counted()
    assert set(failures) <= {"store_full"}
    print(f"eviction: junk stored {codes[0]}, junk left {present}, failures {dict(failures)}")


def test_a_lease_shorter_than_any_read(
    pool: SinglePool, engine: Engine, window: Window, references: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A master whose lease (1 ms) ends before any read completes: Mooncake fails every read
    it granted (LEASE_EXPIRED, -707: the object may have been replaced meanwhile). Lookups
    still find the prefix; each load fails as ``transfer_failed`` and the request recomputes,
    with the reference's tokens. With the default lease, the same stream hits.

    A read of a few small objects over loopback can beat even 1 ms, so each read runs with
    the store process stopped (SIGSTOP) for its first 50 ms: the master grants the lease,
    the transfer waits for the store (one read at a time)."""
    pool.restart_master("--default_kv_lease_ttl=1")
    assert pool.store is not None and pool.store.process is not None
    store_pid = pool.store.process.pid
    store_class = mooncake_store_class()
    original = getattr(store_class, READ_METHOD)
    one_at_a_time = threading.Lock()

    def read_while_the_store_pauses(store: Any, *args: Any) -> Any:
        with one_at_a_time:
            os.kill(store_pid, signal.SIGSTOP)
            resume = threading.Timer(STORE_PAUSE_S, os.kill, (store_pid, signal.SIGCONT))
            resume.start()
            try:
                return original(store, *args)
            finally:
                resume.join()

    monkeypatch.setattr(store_class, READ_METHOD, read_while_the_store_pauses)
    try:
        leased = [engine.serve(k) for k in [(1, 0), (1, 1), (1, 2)]]
    finally:
        monkeypatch.undo()
        os.kill(store_pid, signal.SIGCONT)
    loads = window.failures("load")
    assert not any(s.hit for s in leased), [s.cached for s in leased]
    assert loads["transfer_failed"] > 0 and set(loads) == {"transfer_failed"}, loads
    failures = window.check_counted()
    pool.restart_master()
    healed = serve_until_hits(engine, [(1, 0), (1, 1)])
    check_outputs([*leased, *healed], references)
    assert healed[-1].cached == PREFIX_TOKENS
    print(f"1 ms lease: failures {dict(failures)}")


def test_partial_batch_failures(
    pool: SinglePool, engine: Engine, window: Window, references: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One load, several bounded batches: some keys vanish mid-batch, one batch's RPC fails.

    Every other key of the same load succeeds; the request recomputes (hybrid layout),
    the records and the metrics count each kind, and the pool heals on the next save.
    """
    warm = [engine.serve(k) for k in [(1, 0), (1, 1)]]
    assert warm[1].hit
    state: dict[str, Any] = {}
    original_get = PoolClient.get_into
    store_class = mooncake_store_class()
    original_read = store_class.batch_get_into_multi_buffers

    def get_into(self: PoolClient, keys: Any, ptrs: Any, sizes: Any) -> list[int]:
        if "keys" in state or len(keys) <= 2 * BATCH:
            return original_get(self, keys, ptrs, sizes)
        state["keys"] = list(keys)
        self.remove([keys[1], keys[2]])  # really gone: -704 among successes in batch 1
        state["calls"] = 0
        try:
            return original_get(self, keys, ptrs, sizes)
        finally:
            state["calls"] = None

    def read(store: Any, *args: Any) -> list[int]:
        if state.get("calls") is not None:
            state["calls"] += 1
            if state["calls"] == 2:
                raise RuntimeError("injected: batch 2's RPC failed")
        return original_read(store, *args)

    monkeypatch.setattr(PoolClient, "get_into", get_into)
    monkeypatch.setattr(store_class, READ_METHOD, read)
    mark = window.mark()
    faulted = engine.serve((1, 2))
    monkeypatch.undo()
    assert len(state["keys"]) == 9, "the full-attention group's 9 prefix blocks, in 3 batches"
    healed = engine.serve((1, 3))
    check_outputs([*warm, faulted, healed], references)

    (load, *later) = window.transfers("load", since=mark)
    assert load.failures == {"missing": 2, "rpc_failed": BATCH}
    assert load.recomputed
    assert sum(load.blocks) > 0, "the keys that did not fail were loaded"
    assert all(not t.failures for t in later)
    assert window.check_counted() == {"missing": 2, "rpc_failed": BATCH}
    # The pool heals: at the latest the request after next finds the whole prefix again.
    again = engine.serve((1, 0))
    check_outputs([again], references)
    assert again.cached == PREFIX_TOKENS, (healed.cached, again.cached)


def test_a_recompute_stores_the_blocks_its_load_lost(
    pool: SinglePool, engine: Engine, window: Window, references: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    warm = [engine.serve(k) for k in [(2, 0), (2, 1)]]
    assert warm[1].hit
    removed: list[str] = []
    original_get = PoolClient.get_into

    def get_into(self: PoolClient, keys: Any, ptrs: Any, sizes: Any) -> list[int]:
        if not removed and len(keys) == 9:
            removed.extend([keys[3], keys[4]])
            self.remove(removed)
        return original_get(self, keys, ptrs, sizes)

    monkeypatch.setattr(PoolClient, "get_into", get_into)
    faulted = engine.serve((2, 2))
    monkeypatch.undo()
    assert removed
    healed = engine.serve((2, 3))
    check_outputs([*warm, faulted, healed], references)
    assert healed.cached == PREFIX_TOKENS, f"only {healed.cached} tokens back after the recompute"
