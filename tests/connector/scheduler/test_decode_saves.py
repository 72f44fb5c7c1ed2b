"""Which blocks a request saves: its prompt's, and those it completes while decoding only
with ``save_decode_cache`` (vLLM's real scheduler, a real Mooncake master).

The scheduler is stepped as an engine would: each step's output samples one token per
running request, so decoding fills blocks past the prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpool.connector.metadata import PoolConnectorMetadata
from testing.engine import scheduler_of
from testing.kv_cache import GroupDesc
from testing.models import build_gemma3
from testing.scheduler import (
    local_pool_transfer,
    make_request,
    make_scheduler,
    note_save_plans,
    schedule_answered,
)

pytestmark = pytest.mark.mooncake

BLOCK = 32
FULL = [GroupDesc("full", BLOCK)]
PROMPT_BLOCKS = 3
PROMPT = list(range(7, 7 + PROMPT_BLOCKS * BLOCK + 5))  # 3 whole blocks and 5 tokens
DECODED = 2 * BLOCK  # enough to complete two blocks past the prompt


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3(tmp_path_factory.mktemp("gemma3-decode"))


def _sample_one_each(scheduler: Any, output: Any) -> None:
    """The model runner's answer to ``output``: one token (the same id) per scheduled request."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(output.num_scheduled_tokens)
    scheduler.update_from_output(
        output,
        ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[11] for _ in ids],
            prompt_logprobs_dict={},
            prompt_token_id_logprobs_dict={},
        ),
    )


def saved_block_indices(pool_settings: Any, model_dir: Path, **extra: Any) -> list[int]:
    """Indices (in the request's full-attention blocks) of every block the scheduler plans to save."""
    scheduler = make_scheduler(model_dir, FULL, local_pool_transfer(pool_settings, **extra))
    try:
        request = make_request(scheduler, PROMPT, max_tokens=DECODED + 1)
        scheduler.add_request(request)
        schedule_answered(scheduler)  # its lookup's step: nothing is scheduled
        saved: list[int] = []
        for _ in range(DECODED + 1):
            output = scheduler.schedule()
            meta = output.kv_connector_metadata
            assert isinstance(meta, PoolConnectorMetadata)
            block_ids = request_block_ids(scheduler, request.request_id)
            for save in meta.saves:
                saved += [block_ids.index(b) for b in save.groups[0].block_ids]
            _sample_one_each(scheduler, output)
            if request.is_finished():
                break
        assert request.num_output_tokens >= DECODED, "the request decoded past two more blocks"
        return saved
    finally:
        scheduler.shutdown()


def request_block_ids(scheduler: Any, req_id: str) -> list[int]:
    (ids,) = scheduler.kv_cache_manager.get_block_ids(req_id)
    return list(ids)


def test_a_request_saves_its_prompt_blocks_only_by_default(model_dir, pool_settings) -> None:
    assert saved_block_indices(pool_settings, model_dir) == list(range(PROMPT_BLOCKS))


def test_save_decode_cache_also_saves_blocks_completed_while_decoding(model_dir, pool_settings) -> None:
    saved = saved_block_indices(pool_settings, model_dir, save_decode_cache=True)
    # The prompt's blocks, the one the prompt's tail and the first tokens complete, and the next.
    assert saved == list(range(PROMPT_BLOCKS + 2))


def test_decode_steps_plan_no_save_once_the_prompt_is_planned(model_dir, pool_settings) -> None:
    """A step looks only at requests that may still complete a block to save: decoding a
    prompt whose blocks are all planned costs the connector no save planning at all."""
    scheduler = make_scheduler(model_dir, FULL, local_pool_transfer(pool_settings))
    try:
        side = scheduler_of(scheduler.connector)
        planned = note_save_plans(side)
        request = make_request(scheduler, PROMPT, max_tokens=DECODED + 1)
        scheduler.add_request(request)
        schedule_answered(scheduler)
        output = scheduler.schedule()  # the prefill: plans the prompt's blocks
        assert [len(s.groups[0].block_ids) for s in output.kv_connector_metadata.saves] == [PROMPT_BLOCKS]
        _sample_one_each(scheduler, output)
        planned.clear()
        for _ in range(DECODED):
            output = scheduler.schedule()
            assert output.num_scheduled_tokens.get(request.request_id) == 1
            assert output.kv_connector_metadata.saves == []
            _sample_one_each(scheduler, output)
        assert planned == [], "decode steps planned saves for a prompt saved in full"
    finally:
        scheduler.shutdown()


# --- a local prefix the pool lost ---------------------------------------------------------------
GROWN = PROMPT + list(range(500, 500 + 2 * BLOCK))  # the prompt and two more blocks


def _prefill_saves(scheduler: Any, prompt: list[int]) -> tuple[list[int], list[str]]:
    """Admit a one-token request for ``prompt`` and run its prefill: the indices (in its
    blocks) of the blocks that step plans to save, and their digests."""
    request = make_request(scheduler, prompt, max_tokens=1)
    scheduler.add_request(request)
    schedule_answered(scheduler)  # its lookup's step: nothing is scheduled
    output = scheduler.schedule()
    block_ids = request_block_ids(scheduler, request.request_id)
    saves = [s for s in output.kv_connector_metadata.saves if s.req_id == request.request_id]
    indices = [block_ids.index(b) for s in saves for b in s.groups[0].block_ids]
    digests = [d for s in saves for d in s.groups[0].digests]
    _sample_one_each(scheduler, output)
    return indices, digests


def test_a_local_prefix_the_pool_lost_is_saved_again(model_dir, pool_settings) -> None:
    """A prefix vLLM holds in its local cache but the pool does not (here: the first request's
    saves never ran; in a fleet, a store restarted or a master failed over) is saved again by
    the next request that starts with it, from the local cache: the pool heals even while
    every server keeps the prefix cached and never computes it again."""
    scheduler = make_scheduler(model_dir, FULL, local_pool_transfer(pool_settings))
    try:
        first, _ = _prefill_saves(scheduler, PROMPT)
        assert first == list(range(PROMPT_BLOCKS))
        grown, _ = _prefill_saves(scheduler, GROWN)
        assert grown == list(range(len(GROWN) // BLOCK)), "the lost prefix is saved again"
    finally:
        scheduler.shutdown()


def test_a_local_prefix_the_pool_holds_is_not_saved_again(model_dir, pool_settings, pool_client) -> None:
    from testing.pool_store import put_bytes

    scheduler = make_scheduler(model_dir, FULL, local_pool_transfer(pool_settings))
    try:
        side = scheduler_of(scheduler.connector)
        first, digests = _prefill_saves(scheduler, PROMPT)
        assert first == list(range(PROMPT_BLOCKS))
        for digest in digests:  # what the first request's saves would have stored
            assert put_bytes(pool_client, side.keyspace.key(0, 0, 0, digest), b"x") == 0
        grown, _ = _prefill_saves(scheduler, GROWN)
        assert grown == list(range(PROMPT_BLOCKS, len(GROWN) // BLOCK)), "only the blocks past the prefix"
    finally:
        scheduler.shutdown()


def test_a_steps_new_requests_plan_from_the_block_tables_vllm_put_in_its_output(
    model_dir, pool_settings
) -> None:
    """Save planning reads a request scheduled anew this step from the step's output (the same
    table vLLM's manager holds), others from the manager."""
    from kvpool.connector.connector import step_block_ids

    scheduler = make_scheduler(model_dir, FULL, local_pool_transfer(pool_settings))
    try:
        request = make_request(scheduler, PROMPT, max_tokens=4)
        scheduler.add_request(request)
        schedule_answered(scheduler)
        output = scheduler.schedule()  # the prefill: the request is new in this step
        asked: list[str] = []

        def manager_block_ids(req_id: str) -> Any:
            asked.append(req_id)
            return scheduler.kv_cache_manager.get_block_ids(req_id)

        of = step_block_ids(output, manager_block_ids)
        assert [r.req_id for r in output.scheduled_new_reqs] == [request.request_id]
        assert [list(g) for g in of(request.request_id)] == [request_block_ids(scheduler, request.request_id)]
        assert asked == [], "the new request's table came from the step's output"
        of("not-scheduled-this-step")  # not in this step's output: the manager is asked
        assert asked == ["not-scheduled-this-step"]
        _sample_one_each(scheduler, output)
        decode = scheduler.schedule()  # no new request: the manager's own call, unchanged
        assert step_block_ids(decode, manager_block_ids) is manager_block_ids
    finally:
        scheduler.shutdown()


def _saves_of_next(scheduler: Any, prompt: list[int]) -> list[int]:
    """As :func:`_prefill_saves` for a request that may be admitted without a lookup step."""
    request = make_request(scheduler, prompt, max_tokens=1)
    scheduler.add_request(request)
    output = schedule_answered(scheduler)
    if request.request_id not in output.num_scheduled_tokens:  # it waited for its lookup
        output = scheduler.schedule()
    block_ids = request_block_ids(scheduler, request.request_id)
    saves = [s for s in output.kv_connector_metadata.saves if s.req_id == request.request_id]
    _sample_one_each(scheduler, output)
    return [block_ids.index(b) for s in saves for b in s.groups[0].block_ids]


@pytest.mark.parametrize("load_policy", ["always", "never"])
def test_saves_start_past_the_local_hit_when_the_pool_is_not_asked(
    model_dir, pool_settings, load_policy: str
) -> None:
    """No lookup tells what the pool holds (the local hit covers every block the pool could
    add, or loads are off): the request's saves start past vLLM's own hit, not at block 0
    (vLLM sets the request's computed tokens only after the connector planned them)."""
    scheduler = make_scheduler(model_dir, FULL, local_pool_transfer(pool_settings, load_policy=load_policy))
    try:
        assert _saves_of_next(scheduler, PROMPT) == list(range(PROMPT_BLOCKS))
        if load_policy == "always":  # the same prompt: its whole blocks are all cached locally
            assert _saves_of_next(scheduler, PROMPT) == []
        else:  # loads off: never asked, even for the blocks past the local prefix
            assert _saves_of_next(scheduler, GROWN) == list(range(PROMPT_BLOCKS, len(GROWN) // BLOCK))
    finally:
        scheduler.shutdown()
