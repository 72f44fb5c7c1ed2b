"""The chaos run's faults, injected into a live :class:`~benchmarks.chaos_fleet.Fleet`.

:class:`Injector` plays a schedule (:mod:`testing.chaos_schedule`): each fault in a thread
of its own at its planned time, so faults overlap as planned, each recorded as a
:class:`~testing.chaos_history.FaultRecord` (started, and ended when the part is back:
continued, mounted again, a leader elected, a member healthy, a server serving, the pool's
filler removed). A fault whose injection fails is recorded with its error; the run goes on.

Pool-level faults use a client of the harness's own (no memory of its own): ``pool_full``
puts filler objects (another key prefix) past the pool's capacity, so the master evicts,
and removes them after the hold; ``objects_corrupted`` overwrites (``upsert``) the stored
blocks of a finished answer's prompt, keeping each header and replacing its payload with
random bytes, just before that conversation's next turn loads them from the pool on the
other server: the connector's payload check must catch every one.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.chaos_fleet import POOL_TIMEOUT_S, Fleet
from benchmarks.chaos_traffic import Traffic
from testing.chaos_history import FaultRecord
from testing.chaos_schedule import FaultKind, PlannedFault

FILLER_OBJECT_BYTES = 4 << 20
FILLER_OVER_CAPACITY = 1.25  # filler put, as a share of the pool's capacity
IN_FLIGHT_WAIT_S = 10.0  # longest a server restart waits for a request in flight on it
FILL_DEADLINE_S = 60.0  # longest the filler's puts (or removals) may take: a frozen store stalls them
CANDIDATE_WAIT_S = 30.0  # longest a corruption waits for an answered turn whose conversation goes on


@dataclass
class PoolHands:
    """The harness's own pool client and what it needs to name the servers' keys."""

    address: str
    cache_prefix: str
    labels: Callable[[], dict[str, str] | None]  # a server's vllm:kvpool_key_fingerprint_info
    client: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def store(self) -> Any:
        from testing.pool_store import raw_store

        if self.client is None:
            from benchmarks import pool

            self.client = pool.client(self.address, "chaos-harness")
        return raw_store(self.client)

    def identity(self) -> tuple[str, int]:
        """The servers' key fingerprint and how many KV-cache groups their layout has."""
        labels = self.labels()
        if not labels:
            raise RuntimeError("no key fingerprint on the servers' /metrics yet")
        return labels["fingerprint"], len(labels["groups"].split(","))

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


@dataclass
class Injector:
    """Plays ``schedule`` against ``fleet`` (times relative to ``t0``); records each fault."""

    fleet: Fleet
    traffic: Traffic
    hands: PoolHands
    t0: float
    on_record: Callable[[FaultRecord], None]
    phase: str = "chaos"
    system_blocks: int = 0
    threads: list[threading.Thread] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    planned: int = 0
    ended: list[FaultRecord] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def play(self, schedule: Sequence[PlannedFault]) -> threading.Thread:
        """Start a thread that starts each fault at its time; returns it."""
        self.planned += len(schedule)

        def run() -> None:
            for planned in schedule:
                while self.now() < planned.at and not self.stopping.is_set():
                    # Never negative: the clock may pass ``planned.at`` after the check.
                    time.sleep(max(0.0, min(0.1, planned.at - self.now())))
                if self.stopping.is_set():
                    return
                thread = threading.Thread(target=self.inject, args=(planned,), daemon=True)
                thread.start()
                self.threads.append(thread)

        player = threading.Thread(target=run, daemon=True)
        player.start()
        return player

    def settled(self, for_s: float) -> bool:
        """Whether every planned fault has ended, the last one at least ``for_s`` ago."""
        ended = list(self.ended)
        return (
            len(ended) >= self.planned
            and self.now() - max((f.ended or 0.0 for f in ended), default=0.0) >= for_s
        )

    def wait(self, timeout: float) -> None:
        """Until every started fault has ended (each bounded by its own waits)."""
        deadline = time.monotonic() + timeout
        for thread in list(self.threads):
            thread.join(max(0.0, deadline - time.monotonic()))

    def inject(self, planned: PlannedFault) -> FaultRecord:
        record = FaultRecord(planned.kind.value, planned.target, planned.at, self.now(), phase=self.phase)
        try:
            record.detail = self._do(planned, record) or ""
        except Exception as exc:
            record.error = f"{type(exc).__name__}: {exc}"[:300]
            traceback.print_exc()
        record.ended = self.now()
        self.on_record(record)
        self.ended.append(record)
        return record

    def _do(self, planned: PlannedFault, record: FaultRecord) -> str | None:
        kind, fleet = planned.kind, self.fleet
        if kind == FaultKind.STORE_FROZEN:
            return _frozen("store", fleet.freeze_store, fleet.thaw_store, planned)
        if kind == FaultKind.STORE_RESTARTED:
            fleet.kill_store(planned.target)
            time.sleep(planned.hold)
            fleet.restart_store(planned.target)
            return f"store {planned.target} killed, a new one mounted"
        if kind == FaultKind.LEADER_KILLED:
            killed = fleet.kill_leader()
            fleet.wait_for_leader(POOL_TIMEOUT_S, not_index=killed)
            elected = self.now() - record.started
            leader = fleet.wait_for_leader(POOL_TIMEOUT_S)
            fleet.wait_for_capacity(leader, fleet.segments, POOL_TIMEOUT_S)
            mounted = self.now() - record.started
            time.sleep(max(0.0, planned.hold - mounted))
            fleet.restart_master(killed)
            return f"master {killed} killed; a leader in {elected:.1f} s, stores on it in {mounted:.1f} s"
        if kind == FaultKind.ETCD_MEMBER_RESTARTED:
            assert fleet.etcd is not None
            fleet.etcd.kill(planned.target)
            time.sleep(planned.hold)
            fleet.etcd.restart(planned.target)
            return f"etcd member {planned.target} down {planned.hold:.1f} s"
        if kind == FaultKind.SERVER_RESTARTED:
            deadline = time.monotonic() + IN_FLIGHT_WAIT_S
            while self.traffic.in_flight.get(planned.target, 0) == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            in_flight = self.traffic.in_flight.get(planned.target, 0)
            fleet.kill_server(planned.target)
            killed_at = self.now()
            fleet.restart_server(planned.target)
            back = self.now() - killed_at
            return f"server {planned.target} killed with {in_flight} requests in flight; back in {back:.0f} s"
        if kind == FaultKind.SERVER_FROZEN:
            return _frozen("server", fleet.freeze_server, fleet.thaw_server, planned)
        if kind == FaultKind.POOL_FULL:
            return self._fill_pool(planned.hold)
        if kind == FaultKind.OBJECTS_CORRUPTED:
            return self.corrupt_next_load()
        raise ValueError(f"no injection for {kind}")

    def _fill_pool(self, hold: float) -> str:
        leader = self.fleet.wait_for_leader(POOL_TIMEOUT_S)
        capacity = leader.capacity_bytes()
        value = os.urandom(FILLER_OBJECT_BYTES)
        keys = [
            f"chaos-filler/{self.now():.0f}/{i}"
            for i in range(int(capacity * FILLER_OVER_CAPACITY) // len(value))
        ]
        refused = put = 0
        with self.hands.lock:
            store = self.hands.store()
            deadline = time.monotonic() + FILL_DEADLINE_S
            for key in keys:
                if time.monotonic() > deadline:
                    break
                refused += int(store.put(key, value)) != 0
                put += 1
        time.sleep(hold)
        with self.hands.lock:
            deadline = time.monotonic() + FILL_DEADLINE_S
            for key in keys[:put]:
                if time.monotonic() > deadline:
                    break
                store.remove(key)
        return (
            f"{put} of {len(keys)} filler objects of {len(value) >> 20} MiB put ({refused} refused), "
            f"removed after {hold:.1f} s"
        )

    def corrupt_next_load(self) -> str:
        """Overwrite the pool's blocks of the latest answered prompt whose conversation goes on
        (every group's object of each block past the system prompt), before its next turn."""
        from kvpool.connector.contract.keys import KeySpace, hash_digest
        from kvpool.connector.contract.object_header import HEADER_BYTES
        from testing.prompts import block_hashes

        fingerprint, groups = self.hands.identity()
        keyspace = KeySpace(self.hands.cache_prefix, fingerprint)
        # A fault may strike while the fleet answers nothing (a restart, a frozen store): wait
        # a bounded while for a turn to be answered.
        deadline = time.monotonic() + CANDIDATE_WAIT_S
        candidates = [r for r in self.traffic.completed if self.traffic.goes_on(r)]
        while not candidates and time.monotonic() < deadline:
            time.sleep(0.5)
            candidates = [r for r in self.traffic.completed if self.traffic.goes_on(r)]
        if not candidates:
            raise RuntimeError(f"no answered turn with a next one to come within {CANDIDATE_WAIT_S:.0f} s")
        chosen = candidates[-1]
        digests = [hash_digest(h) for h in block_hashes(chosen.prompt)[self.system_blocks :]]
        keys = [keyspace.key(group, 0, 0, digest) for group in range(groups) for digest in digests]
        replaced = 0
        with self.hands.lock:
            store = self.hands.store()
            for key in keys:
                stored = store.get(key)
                if len(stored) > HEADER_BYTES:
                    payload = os.urandom(len(stored) - HEADER_BYTES)
                    replaced += int(store.upsert(key, bytes(stored[:HEADER_BYTES]) + payload) == 0)
        return (
            f"{replaced} of {len(keys)} objects of user {chosen.user} turn {chosen.turn} "
            f"(request {chosen.id}) overwritten"
        )


def _frozen(
    part: str, freeze: Callable[[int], None], thaw: Callable[[int], None], planned: PlannedFault
) -> str:
    """Stop ``part`` ``planned.target`` for the fault's hold, then continue it (whatever happens)."""
    freeze(planned.target)
    try:
        time.sleep(planned.hold)
    finally:
        thaw(planned.target)
    return f"{part} {planned.target} stopped {planned.hold:.1f} s"
