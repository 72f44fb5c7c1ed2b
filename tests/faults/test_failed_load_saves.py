"""Nothing computed on top of a failed load reaches the pool.

Engine A stores P1. Engine B serves P2, which shares 300 tokens (9 whole blocks) with P1,
while B's reads of blocks 4..8 fail; in the same batch B serves a second request (the
sharer) that shares P2's first 10 blocks. Every load is asynchronous: vLLM caches none of
P2's blocks until the load is reported, and then only those that loaded, so neither P2's
recompute nor the sharer ever reads a block the load left unwritten, and nothing B
stores is computed from one. Then a fresh engine D, a pure consumer, serves each prompt
from the pool: its tokens and log-probabilities must equal a run without any pool, and
it must still take the good prefix from the pool (all of P2's 10 blocks when B saves:
B's recompute replaced what it had to).

The matrix: three layouts (the all-full-attention Gemma3 has one KV-cache group: its loads
fail per block; the all-sliding-window Gemma3 has one group too, but a hit leaves every block
below its window a null block, so a recompute from inside the hit would read them: it fails
per request, as the hybrid Gemma3 does), B as ``kv_both`` and as
``kv_consumer``, and two faults: reads that answer -800 without writing a byte (at the
Mooncake client), and A's objects swapped for 1-byte objects through Mooncake's own
``upsert`` (black box). The negative control hides the failure from vLLM: the same
scenario then poisons the pool, and D's output is wrong (so the loaded KV is used, and
the scenario is sensitive).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from testing.engine import (
    PATIENT_DEADLINES,
    EngineOptions,
    RequestResult,
    create_llm,
    generate,
    scheduler_connector,
    shutdown_llm,
    transfer_config,
    worker_connector,
)
from testing.models import build_gemma3, build_gemma3_full, build_gemma3_window_only
from testing.mooncake_faults import FailingReads, digests_of
from testing.pool_store import raw_store
from testing.prompts import BLOCK, P1, P2, pool_keys

pytestmark = [pytest.mark.faults, pytest.mark.engine, pytest.mark.mooncake, pytest.mark.timeout(600)]

MAX_TOKENS = 8
#: Reuses P2's first 10 blocks (P2's block 9 is computed in the faulted step) and adds its own.
SHARER = P2[: 10 * BLOCK] + [(7 * i) % 497 + 3 for i in range(40)]
PROMPTS = [P2, SHARER]
FAILED_BLOCKS = range(4, 9)  # of the 9 blocks P2 shares with P1
GOOD_PREFIX = 4 * BLOCK  # blocks 0..3: their loads never fail
P2_BLOCKS = (len(P2) - 1) // BLOCK * BLOCK  # all a hit on P2 can serve (320 tokens)
LOGPROB_TOLERANCE = 1e-3


@dataclass
class Model:
    path: Path
    groups: int
    references: list[RequestResult]


@dataclass
class Run:
    results: list[RequestResult]
    transfers: list[Any]
    keyspace: Any = None


def _run(model: Path, config: dict[str, Any] | None, batches: list[list[list[int]]]) -> Run:
    """Each batch as one ``generate`` call on one in-process engine, its local cache emptied first."""
    llm = create_llm(EngineOptions(model=str(model), kv_transfer_config=config, dtype="float32"))
    try:
        results: list[RequestResult] = []
        for batch in batches:
            assert llm.llm_engine.reset_prefix_cache()
            results.extend(generate(llm, batch, MAX_TOKENS, logprobs=True))
        worker = worker_connector()
        transfers = list(worker.recording.transfers) if worker is not None else []
        scheduler = scheduler_connector(llm)
        return Run(results, transfers, None if scheduler is None else scheduler.keyspace)
    finally:
        shutdown_llm(llm)


def _model(path: Path, groups: int) -> Model:
    # Each prompt alone: the reference is a full prefill without any pool.
    return Model(path, groups, _run(path, None, [[p] for p in PROMPTS]).results)


@pytest.fixture(scope="module")
def single_group(tmp_path_factory: pytest.TempPathFactory) -> Model:
    return _model(build_gemma3_full(tmp_path_factory.mktemp("gemma3-full")), 1)


@pytest.fixture(scope="module")
def window_only(tmp_path_factory: pytest.TempPathFactory) -> Model:
    return _model(build_gemma3_window_only(tmp_path_factory.mktemp("gemma3-window")), 1)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Model:
    return _model(build_gemma3(tmp_path_factory.mktemp("gemma3-hybrid")), 3)


def mismatches(results: list[RequestResult], references: list[RequestResult]) -> list[str]:
    """What differs from the references: tokens, or log-probabilities beyond the tolerance."""
    out = []
    for index, (got, want) in enumerate(zip(results, references, strict=True)):
        if got.token_ids != want.token_ids:
            out.append(f"prompt {index}: tokens {got.token_ids} != {want.token_ids}")
            continue
        assert got.logprobs is not None and want.logprobs is not None
        worst = max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True))
        if worst >= LOGPROB_TOLERANCE:
            out.append(f"prompt {index}: log-probabilities differ by up to {worst:.3g}")
    return out


@dataclass
class Outcome:
    b: Run
    d: Run
    reads: FailingReads


def _scenario(
    model: Model,
    role: str,
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
    *,
    b_recovers: bool = True,
) -> Outcome:
    """A stores P1; B serves P2 and the sharer in one batch under ``fault``; D reads the pool
    (deadlines no busy machine reaches: the hits asserted are the faults', not the load's)."""
    a = _run(model.path, transfer_config(settings, **PATIENT_DEADLINES), [[P1]])
    reads = FailingReads(digests_of(P2, FAILED_BLOCKS))
    if fault == "read_fails":
        reads.install(monkeypatch)
    else:  # black box: A's objects of blocks 4..8 become 1-byte objects
        from mooncake.store import MooncakeDistributedStore

        from kvpool.connector.pool_client import open_client

        client = open_client(settings, global_segment_size=0)
        try:
            for key in pool_keys(a.keyspace, P1, model.groups, FAILED_BLOCKS):
                assert MooncakeDistributedStore.upsert(raw_store(client), key, b"x") == 0
        finally:
            client.close()
    b = _run(model.path, transfer_config(settings, role, **PATIENT_DEADLINES), [PROMPTS])
    monkeypatch.undo()
    if b_recovers:
        assert [r.token_ids for r in b.results] == [r.token_ids for r in model.references], "vLLM recovered B"
    if fault == "read_fails":
        assert reads.failed, "B's reads of blocks 4..8 failed"
    consumer = transfer_config(settings, "kv_consumer", **PATIENT_DEADLINES)
    d = _run(model.path, consumer, [[p] for p in PROMPTS])
    return Outcome(b, d, reads)


@pytest.mark.parametrize("role", ["kv_both", "kv_consumer"])
@pytest.mark.parametrize("layout", ["single_group", "window_only", "hybrid"])
def test_no_block_computed_on_a_failed_load_is_stored(
    request: pytest.FixtureRequest,
    layout: str,
    role: str,
    pool_settings: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model: Model = request.getfixturevalue(layout)
    out = _scenario(model, role, pool_settings, monkeypatch, "read_fails")
    assert not mismatches(out.d.results, model.references)
    cached = [r.num_cached_tokens or 0 for r in out.d.results]
    assert min(cached) >= GOOD_PREFIX, cached
    if role == "kv_both":
        # B's recompute of P2 reached the pool, in place of what failed. (A rare run failed here
        # with [128, 128]: P2 and the sharer replacing the same keys emptied them; see
        # test_save_reservations. The message carries B's and D's transfers.)
        transfers = {
            name: [(t.operation, t.blocks, dict(t.failures), t.load_error_blocks) for t in run.transfers]
            for name, run in (("B", out.b), ("D", out.d))
        }
        assert cached[0] == P2_BLOCKS, (cached, transfers)
    else:
        assert not [t for t in out.b.transfers if t.operation == "save"], "a consumer saves nothing"


def test_objects_swapped_for_one_byte_objects(
    single_group: Model, pool_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _scenario(single_group, "kv_both", pool_settings, monkeypatch, "one_byte")
    assert not mismatches(out.d.results, single_group.references)
    cached = [r.num_cached_tokens or 0 for r in out.d.results]
    assert cached[0] == P2_BLOCKS and min(cached) >= GOOD_PREFIX, cached


def test_negative_control_without_the_guards_the_pool_is_poisoned(
    single_group: Model, pool_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same scenario with the failed blocks kept from vLLM: it takes the load for a success
    and caches the unwritten blocks; D loads B's blocks computed on them, and answers wrong."""
    from kvpool.connector.worker.side import WorkerSide

    guards = pytest.MonkeyPatch()
    guards.setattr(WorkerSide, "take_load_errors", lambda self: set())
    try:
        out = _scenario(single_group, "kv_both", pool_settings, monkeypatch, "read_fails", b_recovers=False)
    finally:
        guards.undo()
    assert (out.d.results[0].num_cached_tokens or 0) == P2_BLOCKS
    assert mismatches(out.d.results, single_group.references), "poisoned blocks changed D's output"
