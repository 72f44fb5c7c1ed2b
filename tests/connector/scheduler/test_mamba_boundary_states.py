"""Mamba state blocks to save are the ones vLLM hands off, never read by position.

In ``mamba_cache_mode="align"`` vLLM keeps one state block per retained block
boundary, and its block table is no record of where each state is: speculative
blocks relocate and retired boundaries turn into null blocks. Each step's
scheduler output carries the exact hand-offs (``boundary_state_offloads``:
group, block id, boundary tokens). vLLM's real ``Scheduler`` runs here (a full
group and a Mamba "align" group with a speculative block, chunked prefill), with
the connector and a real master; the CPU engine cannot run Mamba with prefix
caching, so no forward runs: the test reads the save plans.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvpool.connector.contract.keys import hash_digest
from testing.kv_cache import GroupDesc
from testing.models import build_gemma3
from testing.scheduler import local_pool_transfer, make_request, make_scheduler

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(300)]

GROUPS = [GroupDesc("full"), GroupDesc("mamba", speculative_blocks=1)]
MAMBA = 1
CHUNK = 64  # tokens per step: the prompt is prefilled over several steps
PROMPT = 330
STEP_BOUND_S = 60  # against a stuck lookup, not a speed target


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3(tmp_path_factory.mktemp("mamba") / "gemma3")


class Recorder:
    """vLLM's hand-offs of each step, as its scheduler takes them for the connector."""

    def __init__(self, scheduler: Any, replace: dict[int, int] | None = None):
        manager = scheduler.kv_cache_manager
        self.take = manager.take_boundary_state_offloads
        self.replace = replace or {}
        self.steps: list[dict[str, list[tuple[int, int, int]]]] = []
        manager.take_boundary_state_offloads = self

    def __call__(self) -> dict[str, list[tuple[int, int, int]]]:
        offers = self.take()
        # A stand-in for vLLM moving a state elsewhere than the table says.
        offers = {
            req: [(g, self.replace.get(b, b), t) for g, b, t in entries] for req, entries in offers.items()
        }
        self.steps.append(offers)
        return offers


def _prefill(scheduler: Any, recorder: Recorder, request: Any) -> list[tuple[Any, dict[str, Any]]]:
    """Step until ``request`` is prefilled; each step's save plans with its hand-offs."""
    from vllm.v1.outputs import ModelRunnerOutput

    scheduler.add_request(request)
    plans = []
    deadline = time.monotonic() + STEP_BOUND_S
    while request.num_computed_tokens < request.num_prompt_tokens:
        assert time.monotonic() < deadline, "the prompt was not prefilled"
        output = scheduler.schedule()
        ids = list(output.num_scheduled_tokens)
        if not ids:
            time.sleep(0.01)  # its lookup is in flight
        plans.append((output.kv_connector_metadata, recorder.steps[-1]))
        done = {r: scheduler.requests[r].num_computed_tokens + output.num_scheduled_tokens[r] for r in ids}
        runner = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] if done[r] >= scheduler.requests[r].num_tokens else [] for r in ids],
        )
        scheduler.update_from_output(output, runner)
    return plans


def _mamba_saves(
    plans: list[tuple[Any, dict[str, Any]]], req_id: str
) -> list[tuple[list[int], list[str], list]]:
    """Per step: the Mamba group's planned block ids and digests, and vLLM's hand-offs."""
    steps = []
    for meta, offers in plans:
        saves = [s for s in meta.saves if s.req_id == req_id]
        planned = [g for s in saves for g in s.groups if g.group_id == MAMBA]
        handed = [(b, t) for g, b, t in offers.get(req_id, []) if g == MAMBA]
        steps.append(
            ([b for g in planned for b in g.block_ids], [d for g in planned for d in g.digests], handed)
        )
    return steps


def test_mamba_saves_are_the_handed_off_state_blocks(model_dir, pool_settings) -> None:
    scheduler = make_scheduler(
        model_dir, GROUPS, local_pool_transfer(pool_settings), max_num_batched_tokens=CHUNK
    )
    recorder = Recorder(scheduler)
    request = make_request(scheduler, list(range(3, 3 + PROMPT)))
    steps = _mamba_saves(_prefill(scheduler, recorder, request), request.request_id)
    hashes = request.block_hashes
    saved = 0
    for planned, digests, handed in steps:
        whole = [(b, t) for b, t in handed if t % 32 == 0]
        assert planned == [b for b, _ in whole]
        assert digests == [hash_digest(bytes(hashes[t // 32 - 1])) for _, t in whole]
        saved += len(planned)
    assert saved == PROMPT // CHUNK  # one state per chunk boundary of the prompt
    scheduler.finish_requests([request.request_id], _aborted())


def test_a_state_handed_off_elsewhere_is_saved_from_there(model_dir, pool_settings) -> None:
    """Where vLLM says a boundary's state is, not where the table's position points."""
    scheduler = make_scheduler(
        model_dir, GROUPS, local_pool_transfer(pool_settings), max_num_batched_tokens=CHUNK
    )
    elsewhere = {b: 2000 - b for b in range(1, 100)}  # state blocks the table does not list
    recorder = Recorder(scheduler, replace=elsewhere)
    request = make_request(scheduler, list(range(5, 5 + PROMPT)))
    steps = _mamba_saves(_prefill(scheduler, recorder, request), request.request_id)
    planned = [b for step, _, _ in steps for b in step]
    table = set(scheduler.kv_cache_manager.get_block_ids(request.request_id)[MAMBA])
    assert planned and all(b > 1900 for b in planned)
    assert not table & set(planned)
    scheduler.finish_requests([request.request_id], _aborted())


def _aborted() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED
