"""The step's lookup budget on vLLM's real scheduler, against a real Mooncake master: a lookup
answered within ``lookup_budget_ms`` admits its request in the step it arrives; one answered
past it defers the request a step, and its late answer still gives the right hit.

The slow master is the real one held at the client boundary: the scheduler side's
``client.presence`` waits for a gate the test opens (a frozen master could not answer later).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from vllm.v1.request import RequestStatus

from kvpool.connector.contract import metric_names as m
from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.observability.vllm_metrics import records_to_data, series_key
from testing.engine import scheduler_of
from testing.kv_cache import GroupDesc
from testing.models import build_gemma3
from testing.scheduler import PresenceMeter, answer_lookups, local_pool_transfer, make_request, make_scheduler
from tests.connector.scheduler.test_scheduler_lookup import _load_of, store_blocks

pytestmark = pytest.mark.mooncake

FULL = [GroupDesc("full", 32)]
HIT_BLOCKS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3(tmp_path_factory.mktemp("gemma3-budget"))


def _hold_checks(scheduler: Any) -> threading.Event:
    """Hold every existence check of ``scheduler``'s connector until the returned gate opens
    (30 s at most: a test never hangs)."""
    side = scheduler_of(scheduler.connector)
    presence, gate = side.client.presence, threading.Event()

    def held(keys: list[str]) -> tuple[list[bool], str | None]:
        gate.wait(30.0)
        return presence(keys)

    side.client.presence = held
    return gate


def _requests(scheduler: Any, pool_client: Any, seed: int) -> tuple[Any, Any]:
    """A request with ``HIT_BLOCKS`` blocks in the pool and one with none, both added."""
    hit = make_request(scheduler, list(range(seed, seed + HIT_BLOCKS * 32 + 40)))
    store_blocks(pool_client, scheduler, hit, {0: range(HIT_BLOCKS)})
    miss = make_request(scheduler, list(range(seed + 5000, seed + 5000 + 3 * 32 + 7)))
    scheduler.add_request(hit)
    scheduler.add_request(miss)
    return hit, miss


def test_lookups_answered_within_the_budget_are_scheduled_in_their_first_step(
    model_dir: Path, pool_settings: Any, pool_client: Any
) -> None:
    """Fails when every lookup defers its request a step (budget 0, as before)."""
    scheduler = make_scheduler(model_dir, FULL, local_pool_transfer(pool_settings, lookup_budget_ms=1000))
    try:
        side = scheduler_of(scheduler.connector)
        meter = PresenceMeter(scheduler.connector)
        hit, miss = _requests(scheduler, pool_client, seed=11)
        output = scheduler.schedule()
        assert [r.deferred_steps for r in side.stats.drain()[0]] == [0, 0]
        # The hit loads asynchronously from this step on; the miss computes in it.
        assert hit.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert hit.num_computed_tokens == HIT_BLOCKS * 32
        load = _load_of(output, hit.request_id)
        assert load is not None and load.hit_tokens == HIT_BLOCKS * 32
        assert output.num_scheduled_tokens.get(miss.request_id) == miss.num_tokens
        assert _load_of(output, miss.request_id) is None
        assert meter.checks >= 1  # lookups were asked (statistics may add checks)
    finally:
        scheduler.shutdown()


def test_a_lookup_past_the_budget_defers_a_step_and_takes_its_late_answer(
    model_dir: Path, pool_settings: Any, pool_client: Any
) -> None:
    """The master answers after the step's budget: the step goes on without the requests (no
    wait without a deadline), and the next step admits them with the hits they have."""
    scheduler = make_scheduler(model_dir, FULL, local_pool_transfer(pool_settings, lookup_budget_ms=20))
    try:
        side = scheduler_of(scheduler.connector)
        gate = _hold_checks(scheduler)
        hit, miss = _requests(scheduler, pool_client, seed=23)
        first = scheduler.schedule()
        assert not first.num_scheduled_tokens and _load_of(first, hit.request_id) is None
        assert hit.status == miss.status == RequestStatus.WAITING
        # The budget went on the first request's lookup: the second's waited for none.
        assert [side.requests[r.request_id].pending.deferred_steps for r in (hit, miss)] == [1, 1]
        gate.set()
        assert answer_lookups(scheduler.connector)
        second = scheduler.schedule()
        # Each request's record says it waited one step (none more), and the metrics count both.
        lookups, _ = side.stats.drain()
        assert [r.deferred_steps for r in lookups] == [1, 1]
        data = records_to_data(lookups, [])
        assert data["counters"][series_key(m.LOOKUP_DEFERRED_STEPS)] == 2
        assert hit.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        load = _load_of(second, hit.request_id)
        assert load is not None and load.hit_tokens == HIT_BLOCKS * 32 == hit.num_computed_tokens
        assert second.num_scheduled_tokens.get(miss.request_id) == miss.num_tokens
    finally:
        scheduler.shutdown()


def test_the_budget_is_validated_by_name() -> None:
    with pytest.raises(ValidationError, match="lookup_budget_ms") as raised:
        ConnectorSettings(master_server_address="127.0.0.1:1", lookup_budget_ms=-1)
    assert "greater than or equal to 0" in str(raised.value)
    with pytest.raises(ValidationError, match="lookup_budget_ms"):
        ConnectorSettings(master_server_address="127.0.0.1:1", lookup_budget_ms=5000)


def test_an_answer_the_request_waited_on_past_the_lookup_deadline_is_asked_again(
    model_dir: Path, pool_settings: Any, pool_client: Any
) -> None:
    """A deferred request's lookup is answered, then the request is not reached for longer
    than ``lookup_timeout_s`` (the step's token budget, ``max_num_seqs``): its blocks may
    have left the pool since, so it asks again rather than claim them."""
    from kvpool.connector.contract.keys import hash_digest

    timeout_s = 0.2
    transfer = local_pool_transfer(pool_settings, lookup_timeout_s=timeout_s, lookup_budget_ms=0)
    scheduler = make_scheduler(model_dir, FULL, transfer)
    try:
        connector = scheduler.connector
        request = make_request(scheduler, list(range(17, 17 + HIT_BLOCKS * 32 + 40)))
        store_blocks(pool_client, scheduler, request, {0: range(HIT_BLOCKS)})
        assert connector.get_num_new_matched_tokens(request, 0) == (None, False)  # deferred
        assert answer_lookups(connector)
        view = scheduler_of(connector).coordinator.group_block_hashes(0, request.block_hashes)
        keys = [connector.keyspace.key(0, 0, 0, hash_digest(bytes(view[b]))) for b in range(HIT_BLOCKS)]
        assert pool_client.remove(keys) == [0] * HIT_BLOCKS  # (forced: the lookup leased them)
        threading.Event().wait(3 * timeout_s)  # the request waits past the deadline
        claimed = connector.get_num_new_matched_tokens(request, 0)
        if claimed[0] is None:  # asked again
            assert answer_lookups(connector)
            claimed = connector.get_num_new_matched_tokens(request, 0)
        assert claimed == (0, False), "a hit claimed from an answer the pool no longer holds"
    finally:
        scheduler.shutdown()


def test_a_request_reached_less_often_than_the_lookup_deadline_is_still_admitted(
    model_dir: Path, pool_settings: Any, pool_client: Any
) -> None:
    """Each step's forward outlasts ``lookup_timeout_s`` (a saturated engine, a slow CPU
    prefill), so every answer is stale by the time vLLM reaches the request again. The
    request asks again once, then takes the answer it has: it is admitted, never deferred
    step after step (an old answer costs at most a failed load, and a recompute)."""
    timeout_s = 0.2
    transfer = local_pool_transfer(pool_settings, lookup_timeout_s=timeout_s, lookup_budget_ms=0)
    scheduler = make_scheduler(model_dir, FULL, transfer)
    try:
        connector = scheduler.connector
        request = make_request(scheduler, list(range(23, 23 + HIT_BLOCKS * 32 + 40)))
        store_blocks(pool_client, scheduler, request, {0: range(HIT_BLOCKS)})
        answers = []
        for _ in range(6):
            answers.append(connector.get_num_new_matched_tokens(request, 0))
            if answers[-1][0] is not None:
                break
            assert answer_lookups(connector)  # answered during the step's forward ...
            threading.Event().wait(1.5 * timeout_s)  # ... which outlasts the deadline
        assert answers[-1] == (HIT_BLOCKS * 32, True), answers
        assert len(answers) <= 3, answers  # asked again once at most
    finally:
        scheduler.shutdown()
