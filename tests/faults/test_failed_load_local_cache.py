"""A failed load never leaves its blocks in vLLM's own prefix cache.

vLLM caches a request's blocks, hashes included, when it allocates them for a load it
runs before the forward; under ``kv_load_failure_policy=recompute`` it keeps them cached
after that load failed, expecting the same request to rewrite them in its next step. If
the request is aborted (its client went away) or preempted first, its blocks go back to
the free queue still cached, and the next request with the same prefix gets a *local*
hit on blocks that hold whatever was there before: wrong tokens, from no pool at all.

Here, on a real engine with a real pool: engine E stores P1 in the pool; R (P2, which
shares P1's 9-block prefix) loads it while the reads of blocks 4..8 fail; R is aborted
(or preempted) right after; then S, the same prompt in the same engine, must answer
exactly what an engine without any cache answers (tokens and log-probabilities), and
still take the good part of its prefix from a cache (the negative control that the
scenario reaches KV that is reused).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from testing.engine import (
    EngineOptions,
    RequestResult,
    create_llm,
    engine_core,
    generate,
    output_difference,
    request_results,
    sampling_params,
    shutdown_llm,
    transfer_config,
    worker_of,
)
from testing.models import build_gemma3_full
from testing.mooncake_faults import FailingReads, digests_of
from testing.prompts import BLOCK, P1, P2

pytestmark = [pytest.mark.faults, pytest.mark.engine, pytest.mark.mooncake, pytest.mark.timeout(600)]

MAX_TOKENS = 8
FAILED_BLOCKS = range(4, 9)  # of the 9 blocks P2 shares with P1
GOOD_PREFIX = 4 * BLOCK
STEP_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def single_group(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3_full(tmp_path_factory.mktemp("gemma3-full-local-cache"))


@pytest.fixture(scope="module")
def reference(single_group: Path) -> RequestResult:
    """P2 computed by an engine without any cache."""
    llm = create_llm(EngineOptions(model=str(single_group), dtype="float32", enable_prefix_caching=False))
    try:
        (result,) = generate(llm, [P2], MAX_TOKENS, logprobs=True)
        return result
    finally:
        shutdown_llm(llm)


def _step_until(engine: Any, done: Any, outputs: dict[str, Any]) -> None:
    """Step ``engine`` until ``done()``, keeping finished outputs; bounded in time."""
    deadline = time.monotonic() + STEP_DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, "the engine made no progress before its deadline"
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out


def _serve(engine: Any, request_ids: list[str], outputs: dict[str, Any]) -> list[RequestResult]:
    _step_until(engine, lambda: all(r in outputs for r in request_ids), outputs)
    return [request_results([P2], [outputs[r]], logprobs=True)[0] for r in request_ids]


@pytest.mark.parametrize("then", ["aborted", "preempted"])
def test_blocks_of_a_failed_load_are_never_a_local_hit(
    single_group: Path,
    reference: RequestResult,
    pool_settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    then: str,
) -> None:
    config = transfer_config(pool_settings)
    llm = create_llm(EngineOptions(model=str(single_group), kv_transfer_config=config, dtype="float32"))
    try:
        generate(llm, [P1], MAX_TOKENS)  # P1's blocks reach the pool
        worker_of(llm).wait_for_saves()
        engine = llm.llm_engine
        assert engine.reset_prefix_cache()  # E's own cache is empty: only the pool has P1
        scheduler = engine_core(llm).scheduler

        reads = FailingReads(digests_of(P2, FAILED_BLOCKS))
        reads.install(monkeypatch)
        params = sampling_params(MAX_TOKENS, logprobs=True)
        outputs: dict[str, Any] = {}
        engine.add_request("R", {"prompt_token_ids": P2}, params)
        (request,) = scheduler.requests.values()  # vLLM's own id for R
        if then == "aborted":
            # Aborted in the step its load failed in (a client that timed out and hung up).
            _step_until(engine, lambda: bool(reads.failed), outputs)
            engine.abort_request(["R"])
            assert request.is_finished(), "R was aborted"
        else:
            # Preempted once it runs again after the failure (memory pressure).
            from vllm.v1.request import RequestStatus

            running_again = lambda: bool(reads.failed) and request.status == RequestStatus.RUNNING  # noqa: E731
            _step_until(engine, running_again, outputs)
            scheduler.running.remove(request)
            scheduler._preempt_request(request, time.monotonic(), drop_stale_output=True)
        monkeypatch.undo()
        assert reads.failed, "R's reads of blocks 4..8 failed"

        engine.add_request("S", {"prompt_token_ids": P2}, params)
        served = ["S"] if then == "aborted" else ["R", "S"]
        results = _serve(engine, served, outputs)
        for request_id, result in zip(served, results, strict=True):
            problem = output_difference(result, reference)
            assert problem is None, f"{request_id} after R was {then}: {problem}"
        # The scenario reuses KV: S takes at least the blocks whose reads never failed.
        assert (results[-1].num_cached_tokens or 0) >= GOOD_PREFIX, results[-1]
    finally:
        shutdown_llm(llm)
