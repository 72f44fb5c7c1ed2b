"""Batched scheduler lookups: the same hits as each asked alone, one call for a step's waiting
requests, nothing kept for a request that leaves, and a miss past the deadline."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.request import RequestStatus

from kvpool.connector.contract.keys import hash_digest
from kvpool.connector.scheduler.lookups import ASK_AHEAD_KEYS, Lookup, LookupQuery, answer_together
from testing.engine import scheduler_of
from testing.kv_cache import GroupDesc
from testing.pool_store import put_bytes
from tests.connector.scheduler.test_hybrid_hit import EXAMPLES, _drawn_case, layouts

FULL = [GroupDesc("full", 32)]
FULL_SWA = [GroupDesc("full", 32), GroupDesc("sliding_window", 32, window=64)]


def _query(req_id: str, block_hashes: list, max_hit: int) -> LookupQuery:
    now = time.perf_counter()
    return LookupQuery(req_id, list(block_hashes), max_hit + 1, 0, {}, now, 0, now + 3600)


# --- the batched fixed points find the hits each finds alone ----------------------------------


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups=layouts(), data=st.data(), ranks=st.integers(1, 2), requests=st.integers(1, 4))
def test_batched_lookups_find_the_hits_each_finds_alone(
    groups: list[GroupDesc], data: st.DataObject, ranks: int, requests: int
) -> None:
    """Drawn requests (each its own prompt and pool contents) asked together give each the hit,
    masks, answers and key count of its lookup answered alone, and vLLM's hit; the batch makes
    as many calls as the request needing the most rounds."""
    cases = [_drawn_case(groups, data) for _ in range(requests)]
    present_keys: set[str] = set()
    # Rank 1 (when there is one) lacks a drawn present block: a block is held when every rank holds it.
    for n, (_, _, _, present, _) in enumerate(cases):
        for group_id, hashes in present.items():
            for h in hashes:
                present_keys.add(f"c{n}/r0/g{group_id}/{hash_digest(h)}")
                if ranks == 2 and data.draw(st.integers(0, 9), label="rank 1 holds it") > 0:
                    present_keys.add(f"c{n}/r1/g{group_id}/{hash_digest(h)}")
    calls: list[int] = []

    def exists(keys: list[str], deadline: float) -> tuple[list[bool], str | None]:
        if keys:  # as the presence service, no call for no keys
            calls.append(len(keys))
        return [k in present_keys for k in keys], None

    def lookups() -> list[Lookup]:
        out = []
        for n, (_, ours, block_hashes, _, max_hit) in enumerate(cases):

            def prefixes(group_id: int, n: int = n) -> tuple[str, ...]:
                return tuple(f"c{n}/r{r}/g{group_id}/" for r in range(ranks))

            out.append(Lookup(ours, _query(f"r{n}", block_hashes, max_hit), prefixes, lambda g: ranks))
        return out

    alone = lookups()
    rounds = []
    for lookup in alone:
        before = len(calls)
        answer_together([lookup], exists)
        rounds.append(len(calls) - before)
    together = lookups()
    before = len(calls)
    assert answer_together(together, exists) == len(calls) - before == max(rounds, default=0)

    for (coordinator, _, block_hashes, _, max_hit), one, batched in zip(cases, alone, together):
        (hit, known), (batched_hit, batched_known) = one.result, batched.result
        assert batched_hit == hit and batched_hit.needed_blocks == hit.needed_blocks
        assert batched_known == known and batched.asked_keys == one.asked_keys
        assert {g: d for g, d in batched.digests.items() if d} == {g: d for g, d in one.digests.items() if d}
        if ranks == 1:
            _, real_hit, _ = coordinator.find_longest_cache_hit(block_hashes, max_hit)
            assert batched_hit.hit_tokens == real_hit


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups=layouts(), data=st.data())
def test_a_batched_lookup_does_each_rounds_work_once(groups: list[GroupDesc], data: st.DataObject) -> None:
    """Answered from outside, round by round, a lookup resumes its fixed point where it paused
    (issue #32: each round ran the fixed point again from its start, managers and all): vLLM's
    managers run as often as for the same lookup answered within one call, and it finds the
    same hit."""
    from kvpool.connector.scheduler.hybrid_hit import HybridHitCoordinator
    from testing.kv_cache import make_coordinator

    _, _, block_hashes, present, max_hit = _drawn_case(groups, data)
    present_digests = {g: {hash_digest(h) for h in hashes} for g, hashes in present.items()}
    runs: dict[str, int] = {}

    def counted(name: str) -> HybridHitCoordinator:
        coord = HybridHitCoordinator.from_vllm_coordinator(make_coordinator(groups))
        manager_hit = coord._manager_hit
        runs[name] = 0

        def counting(*args: Any, **kwargs: Any) -> Any:
            runs[name] += 1
            return manager_hit(*args, **kwargs)

        coord._manager_hit = counting  # type: ignore[method-assign]
        return coord

    within = counted("within one call")
    wanted = within.lookup_blocks(block_hashes, max_hit)

    def ask(questions: dict[int, list[int]]) -> dict[int, list[bool]]:
        return {
            g: [hash_digest(wanted[g][i]) in present_digests.get(g, set()) for i in indices]
            for g, indices in questions.items()
        }

    hit, _ = within.find_hit_asking(block_hashes, wanted, max_hit, ask, ask_ahead_blocks=ASK_AHEAD_KEYS)

    def exists(keys: list[str], deadline: float) -> tuple[list[bool], str | None]:
        return [k.split("/")[2] in present_digests.get(int(k.split("/")[1]), set()) for k in keys], None

    lookup = Lookup(
        counted("round by round"), _query("r", block_hashes, max_hit), lambda g: (f"p/{g}/",), lambda g: 1
    )
    answer_together([lookup], exists)
    assert lookup.result is not None and lookup.result[0] == hit
    assert runs["round by round"] == runs["within one call"]
    found = lookup.result
    assert lookup.attempt() is None and lookup.result is found, "done: nothing more to ask"
    assert runs["round by round"] == runs["within one call"]


def test_a_round_the_pool_cannot_answer_is_a_miss_for_every_lookup_in_it() -> None:
    from kvpool.connector.scheduler.hybrid_hit import HybridHitCoordinator
    from testing.kv_cache import make_coordinator

    ours = HybridHitCoordinator.from_vllm_coordinator(make_coordinator(FULL_SWA))
    lookups = [
        Lookup(
            ours,
            _query(f"r{n}", [os.urandom(32) for _ in range(6)], 6 * 32 - 1),
            lambda g: ("p/",),
            lambda g: 1,
        )
        for n in range(3)
    ]
    assert answer_together(lookups, lambda keys, deadline: ([False] * len(keys), "timeout")) == 1
    for lookup in lookups:
        hit, _ = lookup.result
        assert hit.hit_tokens == 0 and lookup.failures == {"timeout": 1}


# --- on vLLM's real scheduler and a real Mooncake master -------------------------------------


def _master_counter(local_pool: Any, name: str) -> float:
    for line in local_pool.master.metrics().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported by the master")


def _store(pool_client, scheduler, request, blocks: range) -> None:
    connector = scheduler.connector
    view = scheduler_of(connector).coordinator.group_block_hashes(0, request.block_hashes)
    for i in blocks:
        key = connector.keyspace.key(0, 0, 0, hash_digest(bytes(view[i])))
        assert put_bytes(pool_client, key, b"kv" * 8) == 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    from testing.models import build_gemma3

    return build_gemma3(tmp_path_factory.mktemp("gemma3-batched"))


@pytest.mark.mooncake
def test_a_steps_waiting_requests_are_looked_up_in_one_call(
    model_dir, pool_settings, pool_client, local_pool
) -> None:
    from testing.scheduler import local_pool_transfer, make_request, make_scheduler, schedule_answered

    scheduler = make_scheduler(model_dir, FULL, local_pool_transfer(pool_settings))
    try:
        requests = [make_request(scheduler, list(range(n * 1000, n * 1000 + 4 * 32 + 1))) for n in range(16)]
        for n, request in enumerate(requests):
            _store(pool_client, scheduler, request, range(n % 5))
        calls = _master_counter(local_pool, "master_batch_exist_key_requests_total")
        for request in requests:
            scheduler.add_request(request)
        first = schedule_answered(scheduler)
        assert not first.num_scheduled_tokens, "no request is admitted before its lookup is answered"
        assert _master_counter(local_pool, "master_batch_exist_key_requests_total") - calls == 1
        assert scheduler.connector.stats.lookups == [], "a lookup is recorded when its request takes it"

        output = scheduler.schedule()
        loads = {load.req_id: load for load in output.kv_connector_metadata.loads}
        for n, request in enumerate(requests):
            if n % 5 == 0:  # a miss computes its prompt now
                assert output.num_scheduled_tokens[request.request_id] == 4 * 32 + 1
                assert request.request_id not in loads
            else:  # a hit waits for its load (every load is asynchronous), then computes the rest
                assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                assert request.num_computed_tokens == (n % 5) * 32
                assert len(loads[request.request_id].groups[0].block_ids) == n % 5
        lookups = scheduler.connector.stats.lookups
        assert sorted(r.hit_tokens for r in lookups) == sorted((n % 5) * 32 for n in range(16))
        assert all(r.keys == 4 for r in lookups)
        assert _master_counter(local_pool, "master_batch_exist_key_requests_total") - calls == 1
    finally:
        scheduler.shutdown()


@pytest.mark.mooncake
def test_lookup_statistics_are_computed_before_vllm_exports_them(
    model_dir, pool_settings, pool_client
) -> None:
    """Per-group statistics are computed on the connector's threads once the master has
    answered (with the lookup, when it asked about every block: the record holds the numbers),
    so the scheduler step that exports them only reads them."""
    from testing.scheduler import (
        local_pool_transfer,
        make_request,
        make_scheduler,
        schedule_answered,
        settle,
    )

    scheduler = make_scheduler(model_dir, FULL_SWA, local_pool_transfer(pool_settings))
    try:
        requests = [make_request(scheduler, list(range(n * 1000, n * 1000 + 6 * 32 + 1))) for n in range(4)]
        for n, request in enumerate(requests):
            _store(pool_client, scheduler, request, range(n))
        for request in requests:
            scheduler.add_request(request)
        schedule_answered(scheduler)
        scheduler.schedule()
        side = scheduler_of(scheduler.connector)
        assert settle(scheduler.connector)
        lookups = scheduler.connector.stats.lookups
        assert len(lookups) == 4

        def computing_now(*args: Any) -> Any:
            raise AssertionError("statistics computed when read, on the scheduler thread")

        side.coordinator.group_hits = computing_now  # any computing from here on fails
        assert sorted(r.present_blocks[0] for r in lookups) == [0, 1, 2, 3]
        assert sorted(r.group_hit_tokens[0] for r in lookups) == [0, 32, 64, 96]
    finally:
        scheduler.shutdown()


@pytest.mark.mooncake
def test_a_request_that_leaves_while_its_lookup_is_in_flight_is_forgotten(
    model_dir, pool_settings, pool_client
) -> None:
    from testing.scheduler import answer_lookups, local_pool_transfer, make_request, make_scheduler

    scheduler = make_scheduler(model_dir, FULL_SWA, local_pool_transfer(pool_settings))
    side = scheduler_of(scheduler.connector)
    real_presence, gate, asked = side.client.presence, threading.Event(), threading.Event()

    def held_presence(keys: list[str]) -> tuple[list[bool], str | None]:
        asked.set()
        gate.wait(30)
        return real_presence(keys)

    side.client.presence = held_presence  # the real check, held until the request has left
    try:
        leaving = make_request(scheduler, list(range(7, 7 + 6 * 32)))
        staying = make_request(scheduler, list(range(9, 9 + 6 * 32)))
        scheduler.add_request(leaving)
        scheduler.add_request(staying)
        scheduler.schedule()
        assert asked.wait(30)
        leaving_lookup = side.requests[leaving.request_id].pending
        scheduler.finish_requests([leaving.request_id], RequestStatus.FINISHED_ABORTED)
        scheduler.schedule()  # hands the finished id to the connector
        gate.set()
        assert answer_lookups(scheduler.connector)
        assert leaving_lookup.cancelled, "its lookup, in flight when it left, is dropped"
        output = scheduler.schedule()
        assert list(output.num_scheduled_tokens) == [staying.request_id]
        assert leaving.request_id not in side.requests, "nothing is kept of it"
        assert [r.query_tokens for r in scheduler.connector.stats.lookups] == [6 * 32]
    finally:
        gate.set()
        side.client.presence = real_presence
        scheduler.shutdown()


@pytest.mark.mooncake
def test_a_lookup_past_its_deadline_is_a_miss_with_the_master_frozen(
    model_dir, pool_settings, pool_client, local_pool
) -> None:
    from testing.scheduler import local_pool_transfer, make_request, make_scheduler

    scheduler = make_scheduler(model_dir, FULL, local_pool_transfer(pool_settings, lookup_timeout_s=0.3))
    master = local_pool.master.process
    try:
        request = make_request(scheduler, list(range(3, 3 + 4 * 32 + 1)))
        _store(pool_client, scheduler, request, range(4))
        scheduler.add_request(request)
        os.kill(master.pid, signal.SIGSTOP)
        try:
            steps = 0
            while request.status == RequestStatus.WAITING:
                assert steps < 1000, "the request never left the waiting queue"
                output = scheduler.schedule()
                steps += 1
                time.sleep(0.01)
        finally:
            os.kill(master.pid, signal.SIGCONT)
        # Skipped while in flight, then admitted computing its whole prompt: the pool's four
        # blocks were a miss.
        assert steps > 1 and output.num_scheduled_tokens[request.request_id] == 4 * 32 + 1
        (record,) = scheduler.connector.stats.lookups
        assert record.hit_tokens == 0 and record.failures == {"timeout": 1}
    finally:
        os.kill(master.pid, signal.SIGCONT)
        scheduler.shutdown()
