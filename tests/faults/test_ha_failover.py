"""HA failover: the leading master is killed while a real engine serves a shared-prefix stream.

Real etcd, two real ``mooncake_master --enable_ha`` processes, a real store process, and a
real vLLM CPU engine whose connector addresses the pool as ``etcd://``. The standby takes
over with an empty key set; the pool refills from the stream itself. Guarantees checked:
no request hangs, every output equals its reference, hits come back, failures are counted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.connector.contract.settings import ConnectorSettings
from testing.engine import transfer_config
from tests.faults.helpers import (
    PREFIX_TOKENS,
    Engine,
    HAPool,
    Served,
    check_outputs,
    failures_by_reason,
    stream,
)

pytestmark = [pytest.mark.faults, pytest.mark.engine, pytest.mark.mooncake, pytest.mark.timeout(900)]

WARM_UP = 7  # requests before the kill: every prefix stored, then hit
MAX_REQUESTS = 300  # the whole stream, at most (the time budget bounds it too)
STREAM_BUDGET_S = 600.0  # a bound against a stuck stream, not a speed target: CI cores are shared
HITS_AFTER = 4  # hits after failover that end the stream
REQUEST_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def ha_pool() -> Iterator[HAPool]:
    pool = HAPool(segment_size="128MB").start()
    try:
        yield pool
    finally:
        pool.stop()


def test_leader_killed_mid_stream(
    gemma_dir: Path, references: dict, ha_pool: HAPool, record_property: pytest.RecordProperty
) -> None:
    settings = ConnectorSettings.parse({"master_server_address": ha_pool.address, "cache_prefix": "ha"})
    engine = Engine(gemma_dir, transfer_config(settings), log_stats=True)
    try:
        served, killed_at, elected_at = _serve_through_failover(engine, ha_pool)
        undrained = engine.undrained_failures()
        transfers = engine.transfers()
        lookups = engine.lookups()
        series = engine.failure_series()
    finally:
        engine.close()

    check_outputs(served, references)
    before = [s for s in served if s.finished < killed_at]
    after = [s for s in served if s.started > killed_at]
    assert any(s.hit for s in before), "the pool served hits before the fault"
    assert not after[0].hit, "the standby leads with an empty pool"
    assert [s for s in after if s.hit][:HITS_AFTER] and sum(s.hit for s in after) >= HITS_AFTER, (
        "hits resumed after failover"
    )
    assert all(s.cached in (0, PREFIX_TOKENS, PREFIX_TOKENS + 32) for s in served)
    first_hit = next(s for s in after if s.hit)
    last_hit = max(s.finished for s in before if s.hit)
    no_hits_s = first_hit.finished - killed_at
    slowest = max(s.seconds for s in served)
    # The outage cost failed transfers, each counted by reason, and the metrics agree.
    failures = failures_by_reason(transfers)
    assert failures, "the outage shows in the failure counts"
    # A transfer in flight when the leader died either gets Mooncake's code back or passes the
    # connector's deadline (then it is recomputed, counted as a timeout): both end in bounded time.
    assert set(failures) <= {"rpc_failed", "store_full", "missing", "transfer_failed", "timeout"}
    # The series counts lookups that failed too (a lookup in flight when the leader died
    # passes its deadline: a miss, counted as a timeout).
    assert set(failures_by_reason(lookups)) <= {"rpc_failed", "timeout"}
    assert series == failures + failures_by_reason(lookups) - undrained
    figures = {
        "requests": len(served),
        "election_s": round(elected_at - killed_at, 2),
        "no_hits_s": round(no_hits_s, 2),
        "gap_between_hits_s": round(first_hit.finished - last_hit, 2),
        "slowest_request_s": round(slowest, 2),
        "failures": dict(failures),
    }
    record_property("figures", figures)
    print(f"HA failover figures: {figures}")
    assert slowest < REQUEST_DEADLINE_S


def _serve_through_failover(engine: Engine, pool: HAPool) -> tuple[list[Served], float, float]:
    """Serve the stream; kill the leader during request ``WARM_UP``; stop once hits are back."""
    old_leader = pool.leader()
    assert old_leader is not None
    killed = threading.Event()
    times: dict[str, float] = {}

    def kill() -> None:
        old_leader.kill()
        times["killed"] = time.monotonic()
        killed.set()
        deadline = times["killed"] + 60
        while time.monotonic() < deadline:
            leader = pool.leader()
            if leader is not None and leader is not old_leader:
                times["elected"] = time.monotonic()
                return
            time.sleep(0.05)

    served: list[Served] = []
    started = time.monotonic()
    for index, key in enumerate(stream(MAX_REQUESTS)):
        if index == WARM_UP:
            # Lands inside this request: during its lookup, load, forward or save.
            killer = threading.Timer(0.2, kill)
            killer.daemon = True
            killer.start()
        served.append(engine.serve(key, deadline_s=REQUEST_DEADLINE_S))
        if killed.is_set() and sum(s.hit for s in served if s.started > times["killed"]) >= HITS_AFTER:
            break
        assert time.monotonic() - started < STREAM_BUDGET_S, "the stream ran past its time budget"
    assert killed.wait(5), "the leader was killed"
    new_leader = pool.wait_for_leader(30)
    assert new_leader is not old_leader
    assert "elected" in times, "the standby took over"
    return served, times["killed"], times["elected"]
