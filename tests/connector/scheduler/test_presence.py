"""The presence service: one thread, batched checks, lookups first, and no wait past a deadline.

Most tests hold the pool's answer at a gate and move the service's clock by hand (no
sleeping on deadlines). Their pool is a set of keys in memory, standing in for the
master where only the service's order and deadlines are under test; the first test
asks a real Mooncake master, and ``tests/connector/integrity/test_pool_integrity.py``
stalls a real one.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvpool.connector.scheduler.hybrid_hit import HybridHitCoordinator
from kvpool.connector.scheduler.lookups import Lookup, LookupQuery
from kvpool.connector.scheduler.presence import PendingLookup, PresenceService
from testing.kv_cache import GroupDesc, make_coordinator
from testing.pool_store import put_bytes


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Gate:
    """``exists`` held until :attr:`open` is set; records each call's keys."""

    def __init__(self, exists: Callable[[list[str]], list[bool]]):
        self.exists = exists
        self.calls: list[list[str]] = []
        self.open = threading.Event()

    def __call__(self, keys: list[str]) -> list[bool]:
        self.calls.append(list(keys))
        self.open.wait(30)
        return self.exists(keys)


def until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.005)


def held(keys: list[str]) -> list[bool]:
    """The stand-in pool: it holds every key named ``held*``."""
    return [k.startswith("held") for k in keys]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def gate() -> Iterator[Gate]:
    gate = Gate(held)
    yield gate
    gate.open.set()


def service(
    exists: Callable[[list[str]], list[bool]], clock: Clock, name: str = "test-presence"
) -> PresenceService:
    return PresenceService(exists, lambda lookup: lookup.result, timeout_s=1.0, name=name, clock=clock)


_COORD: list[HybridHitCoordinator] = []


def lookup(deadline: float, blocks: int = 4) -> Lookup:
    """A full-attention lookup of ``blocks`` random blocks, its deadline on the test's clock."""
    if not _COORD:
        _COORD.append(HybridHitCoordinator.from_vllm_coordinator(make_coordinator([GroupDesc("full", 32)])))
    query = LookupQuery("r", [os.urandom(32) for _ in range(blocks)], blocks * 32, 0, {}, 0.0, 0, deadline)
    return Lookup(_COORD[0], query, lambda g: ("held/",), lambda g: 1)


def send(presence: PresenceService, *lookups: Lookup) -> list[PendingLookup]:
    pending = [presence.queue(one) for one in lookups]
    presence.flush()
    return pending


# --- statistics' questions ----------------------------------------------------------------


@pytest.mark.mooncake
def test_questions_waiting_behind_a_check_go_out_together_and_none_waits_past_its_deadline(
    pool_client, clock: Clock
) -> None:
    key = "kvpool-test/held"
    assert put_bytes(pool_client, key, b"kv") == 0
    gate = Gate(pool_client.exists)
    presence = service(gate, clock)
    try:
        first = presence.ask(lambda: [key])
        until(lambda: len(gate.calls) == 1, "the first question is in flight")
        waiting = [presence.ask(lambda k=k: [key, f"kvpool-test/absent-{k}"]) for k in range(3)]
        clock.now = 2.0  # the first check is past its deadline: nobody waits for it
        assert presence.stuck
        assert first.result() is None
        late = presence.ask(lambda: [key])
        assert late.done and late.result() is None, "refused at once while a check is stuck"
        clock.now = 0.0
        gate.open.set()
        assert presence.wait_idle(30)
        # The three questions that waited went out in one check, in order.
        assert [len(keys) for keys in gate.calls] == [1, 6]
        assert [w.result() for w in waiting] == [[True, False]] * 3
    finally:
        gate.open.set()
        presence.close()
    closed = presence.ask(lambda: [key])
    assert closed.done and closed.result() is None


def test_follow_ups_run_once_whether_queued_before_or_after_the_answer(clock: Clock, gate: Gate) -> None:
    """What a lookup queues with ``then`` runs once on the service's thread after the answer,
    or at once when the answer came first (never lost, never twice)."""
    presence = service(gate, clock, name="test-presence-follow-ups")
    ran: list[tuple[str, str]] = []
    try:
        early = presence.ask(lambda: ["held"])
        early.then(lambda: ran.append(("early", threading.current_thread().name)))
        until(lambda: len(gate.calls) == 1, "the question is in flight")
        assert ran == [], "nothing runs before the answer"
        gate.open.set()
        assert presence.wait_idle(30)
        assert ran == [("early", "test-presence-follow-ups")]
        late = presence.ask(lambda: ["held"])
        assert presence.wait_idle(30)
        late.then(lambda: ran.append(("late", threading.current_thread().name)))
        assert ran[1:] == [("late", threading.current_thread().name)]
        assert late.result() == [True]
    finally:
        presence.close()


def test_the_service_reports_its_threads_cpu_time(clock: Clock, gate: Gate) -> None:
    """What the benchmarks read as the lookups' cost off the scheduler's hooks."""
    presence = service(gate, clock, name="test-presence-cpu")
    try:
        assert presence.cpu_seconds == 0.0, "no thread yet"
        gate.open.set()
        send(presence, *(lookup(deadline=10.0, blocks=64) for _ in range(50)))
        assert presence.wait_idle(30)
        used = presence.cpu_seconds
        assert used > 0.0
        assert presence.cpu_seconds >= used, "a clock of its own, never back"
    finally:
        presence.close()


# --- lookups ------------------------------------------------------------------------------


def test_lookups_go_before_the_statistics_waiting_with_them(clock: Clock, gate: Gate) -> None:
    presence = service(gate, clock)
    try:
        presence.ask(lambda: ["held/first-question"])
        until(lambda: len(gate.calls) == 1, "a question is in flight")
        second = presence.ask(lambda: ["held/second-question"])
        (pending,) = send(presence, lookup(deadline=10.0))
        assert not presence.wait_idle(0, lookups_only=True), "the lookup waits behind the check in flight"
        gate.open.set()
        assert presence.wait_idle(30)
        asked = ["held/" + digest for digest in pending.lookup.digests[0].values()]
        assert gate.calls == [["held/first-question"], asked, ["held/second-question"]]
        assert pending.answered and pending.outcome[0].hit_tokens == 3 * 32  # all held: up to the last token
        assert second.result() == [True]
    finally:
        presence.close()


def test_a_check_past_its_deadline_is_a_miss_and_refuses_lookups_until_it_returns(
    clock: Clock, gate: Gate
) -> None:
    presence = service(gate, clock)
    try:
        (stuck,) = send(presence, lookup(deadline=1.0))
        until(lambda: len(gate.calls) == 1, "the lookup's check is in flight")
        clock.now = 2.0
        assert presence.stuck
        # Flushed while a check is stuck: refused at once (a miss), never queued behind it.
        (refused,) = send(presence, lookup(deadline=3.0))
        assert refused.answered and refused.outcome is None
        assert presence.ask(lambda: ["held"]).result() is None
        gate.open.set()
        until(lambda: stuck.answered, "the stuck check returns")
        # Answered past its deadline: a miss.
        hit, _ = stuck.outcome
        assert hit.hit_tokens == 0 and stuck.lookup.failures == {"timeout": 1}
        assert not presence.stuck
        (again,) = send(presence, lookup(deadline=3.0))
        until(lambda: again.answered, "lookups are answered again")
        assert again.outcome[0].hit_tokens == 3 * 32 and again.lookup.failures == {}
        assert len(gate.calls) == 2, "nothing refused reached the pool"
    finally:
        presence.close()


def test_a_lookup_sent_past_its_deadline_is_a_miss_without_a_check(clock: Clock, gate: Gate) -> None:
    gate.open.set()
    presence = service(gate, clock)
    try:
        clock.now = 5.0
        (late,) = send(presence, lookup(deadline=1.0))
        assert presence.wait_idle(30, lookups_only=True)
        assert late.outcome[0].hit_tokens == 0 and late.lookup.failures == {"timeout": 1}
        assert gate.calls == []
    finally:
        presence.close()


def test_a_cancelled_lookup_is_never_asked_about(clock: Clock, gate: Gate) -> None:
    presence = service(gate, clock)
    try:
        presence.ask(lambda: ["held"])
        until(lambda: len(gate.calls) == 1, "a question is in flight")
        gone, kept = send(presence, lookup(deadline=10.0), lookup(deadline=10.0))
        gone.cancel()
        gate.open.set()
        assert presence.wait_idle(30)
        assert kept.answered and kept.outcome is not None
        assert not gone.answered and gone.lookup.asked_keys == 0
        assert len(gate.calls) == 2
    finally:
        presence.close()


# --- failures and closing -------------------------------------------------------------------


def test_a_check_that_raises_is_a_miss_and_the_thread_serves_on(clock: Clock) -> None:
    failing = [True]

    def exists(keys: list[str]) -> list[bool]:
        if failing:
            failing.clear()
            raise RuntimeError("pool said no")
        return held(keys)

    presence = service(exists, clock, name="test-presence-errors")
    try:
        (broken,) = send(presence, lookup(deadline=10.0))
        assert presence.wait_idle(30)
        assert broken.answered and broken.outcome is None, "a miss: nothing to take"
        (fine,) = send(presence, lookup(deadline=10.0))
        assert presence.wait_idle(30)
        assert fine.outcome[0].hit_tokens == 3 * 32
    finally:
        presence.close()
    until(
        lambda: "test-presence-errors" not in {t.name for t in threading.enumerate()},
        "the thread stops at close",
    )


def test_a_check_the_pool_could_not_answer_is_a_miss_counted_with_its_reason(clock: Clock) -> None:
    """``exists`` may say why the pool could not tell (the client's ``presence``): then every
    lookup it served misses with that reason, whatever the flags, and statistics get none."""
    failure = ["rpc_failed"]

    def presence_of(keys: list[str]) -> tuple[list[bool], str | None]:
        return held(keys), (failure.pop() if failure else None)

    presence = PresenceService(presence_of, lambda lookup: lookup.result, timeout_s=1.0, clock=clock)
    try:
        (unanswered,) = send(presence, lookup(deadline=10.0))
        assert presence.wait_idle(30)
        hit, _ = unanswered.outcome
        assert hit.hit_tokens == 0 and unanswered.lookup.failures == {"rpc_failed": 1}
        (answered,) = send(presence, lookup(deadline=10.0))
        assert presence.wait_idle(30)
        assert answered.outcome[0].hit_tokens == 3 * 32 and answered.lookup.failures == {}
        failure.append("timeout")
        assert presence.ask(lambda: ["held"]).result() is None
    finally:
        presence.close()


def test_close_refuses_what_is_left_and_waits_for_no_stuck_check(clock: Clock, gate: Gate) -> None:
    presence = service(gate, clock)
    question = presence.ask(lambda: ["held"])
    until(lambda: len(gate.calls) == 1, "a question is in flight")
    queued = presence.ask(lambda: ["held"])
    (pending,) = send(presence, lookup(deadline=10.0))
    clock.now = 2.0  # stuck: close does not wait for it
    presence.close()
    assert pending.answered and pending.outcome is None
    assert queued.done and queued.result() is None
    assert question.result() is None
    (after,) = send(presence, lookup(deadline=10.0))
    assert after.answered and after.outcome is None
