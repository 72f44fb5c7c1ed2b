"""A wedged existence call does not keep the pool's hits away after an HA failover.

benchmarks/README.md, finding 9: after a store was frozen and the leading master killed, one
``batch_is_exist`` of a server's client stayed inside Mooncake for ~4.5 minutes, far past its
RPC timeout (``store_timeout_s``); the scheduler's presence service, whose one thread it held,
refused every lookup meanwhile. Real etcd, two real ``mooncake_master --enable_ha``, a real
store process (frozen with SIGSTOP), real Mooncake clients, the real
:class:`~kvpool.connector.scheduler.presence.PresenceService`. The one fake is the wedge itself,
which no short run reproduces on demand: ``batch_is_exist`` of the one client under test is
patched to block until the test releases it, as that call did; the spare client it opens, like
every other, calls the real method.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.local.pool import wait_for_capacity
from kvpool.connector.pool_client import PoolClient, open_client
from kvpool.connector.scheduler.presence import PresenceService
from testing.exists_wedge import Wedge
from testing.pool_store import put_bytes, raw_store
from tests.faults.helpers import HAPool

pytestmark = [pytest.mark.faults, pytest.mark.mooncake, pytest.mark.timeout(300)]

KEYS = [f"wedge/{i}" for i in range(4)]
STORE_TIMEOUT_S = 1  # Mooncake's RPC timeout; a check past it plus the grace is wedged
HANG_GUARD_S = 90.0  # a bound against a test that never sees hits again, not a speed target


@pytest.fixture
def ha_pool() -> Iterator[HAPool]:
    pool = HAPool(segment_size="64MB").start()
    try:
        yield pool
    finally:
        assert pool.store is not None and pool.store.process is not None
        if pool.store.process.poll() is None:
            os.kill(pool.store.process.pid, signal.SIGCONT)
        pool.stop()


def _ask(presence: PresenceService) -> list[bool] | None:
    return presence.ask(lambda: list(KEYS)).result()


def _put_all(client: PoolClient) -> None:
    """Store every key (the new leader starts empty); retried while the client finds the leader."""
    end = time.monotonic() + HANG_GUARD_S
    for key in KEYS:
        while put_bytes(client, key, b"kv" * 64) != 0:
            assert time.monotonic() < end, "the new leader took no put"
            time.sleep(0.2)


def existence_lanes() -> set[threading.Thread]:
    """The existence lanes alive in this process now."""
    return {t for t in threading.enumerate() if t.name.startswith("kvpool-exists")}


def test_hits_again_while_a_wedged_check_holds(
    ha_pool: HAPool, monkeypatch: pytest.MonkeyPatch, record_property: pytest.RecordProperty
) -> None:
    lanes_before = existence_lanes()
    settings = ConnectorSettings.parse(
        {"master_server_address": ha_pool.address, "store_timeout_s": STORE_TIMEOUT_S}
    )
    client = open_client(settings, global_segment_size=0)
    presence = PresenceService(client.exists, lambda lookup: None, timeout_s=2.0, name="kvpool-presence-test")
    wedge: Wedge | None = None
    try:
        _put_all(client)
        assert _ask(presence) == [True] * len(KEYS)

        # The fault: a store frozen, the leader killed, and the check in flight wedged.
        wedge = Wedge(raw_store(client)).install(monkeypatch)
        assert ha_pool.store is not None and ha_pool.store.process is not None
        os.kill(ha_pool.store.process.pid, signal.SIGSTOP)
        old_leader = ha_pool.leader()
        assert old_leader is not None
        old_leader.kill()
        assert _ask(presence) is None, "the wedged check answers nothing"
        assert wedge.in_flight == 1
        new_leader = ha_pool.wait_for_leader(60)
        assert new_leader is not old_leader
        os.kill(ha_pool.store.process.pid, signal.SIGCONT)
        wait_for_capacity(new_leader, 60)
        _put_all(client)  # transfers never took the wedge: only existence checks hold
        fault_ended = time.monotonic()

        # The pool answers again while the wedged call still holds the client's lane.
        flags = None
        while flags != [True] * len(KEYS):
            assert time.monotonic() - fault_ended < HANG_GUARD_S, "no hits after the fault ended"
            flags = _ask(presence)
            if flags is None:
                time.sleep(0.2)
        back_after_s = time.monotonic() - fault_ended
        assert wedge.in_flight == 1, "answered by a spare while the wedged call holds"
        assert client.answering_from_spare
        assert client.wedged_exists >= 1, "the wedged check is counted"

        # Once the wedged call returns, the client answers again (the spare stays, idle).
        wedge.release()
        end = time.monotonic() + HANG_GUARD_S
        while wedge.in_flight:
            assert time.monotonic() < end
            time.sleep(0.05)
        assert not client.answering_from_spare
        assert _ask(presence) == [True] * len(KEYS)
        record_property("figures", {"hits_back_after_fault_s": round(back_after_s, 2)})
        print(
            f"hits back {back_after_s:.2f} s after the fault ended (bound: 2 x {client.exists_deadline_s} s)"
        )
    finally:
        if wedge is not None:
            wedge.release()
        presence.close()
        client.close()
    lanes = [t for t in existence_lanes() if t not in lanes_before]  # clients of other tests keep theirs
    for thread in lanes:
        thread.join(10)
    assert not [t for t in lanes if t.is_alive()], "every existence lane ends with its client"
