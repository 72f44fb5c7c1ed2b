"""A step whose forward raises stores none of its blocks.

vLLM's model runner calls the connector's ``wait_for_save`` in the ``finally`` around the
forward (``_get_kv_connector_output``), so a forward that raises (out of device memory
half-way through the layers, a kernel fault) still reaches it. The step's blocks then hold
whatever they held before (another request's KV, or zeros); saved, they would carry a
valid header and checksum, and no load check could tell them from good KV.

A real in-process engine (vLLM's V1 CPU model runner) with the connector and a real
Mooncake pool: engine A's forward raises on P1's prefill (before any layer runs, so its
blocks keep what they held), then A shuts down, which drains every save in flight. None
of P1's keys is in the pool, and a fresh engine B serves P1 by computing it, its output
equal to the reference. The negative control makes the connector blind to the exception:
A's blocks reach the pool, and B, loading them, answers wrong (so the scenario is
sensitive and B's loaded KV is used).
"""

from __future__ import annotations

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
from testing.models import build_gemma3
from testing.pool_store import raw_store
from testing.prompts import P1, PREFIX_HIT, pool_keys

pytestmark = [pytest.mark.faults, pytest.mark.engine, pytest.mark.mooncake, pytest.mark.timeout(600)]

MAX_TOKENS = 8
GROUPS = 3  # the hybrid Gemma3's KV-cache groups


class ForwardFault(RuntimeError):
    """The injected failure of a forward."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_gemma3(tmp_path_factory.mktemp("gemma3-forward-fault"))


@pytest.fixture(scope="module")
def reference(model: Any) -> RequestResult:
    llm = create_llm(EngineOptions(model=str(model), dtype="float32"))
    try:
        return generate(llm, [P1], MAX_TOKENS, logprobs=True)[0]
    finally:
        shutdown_llm(llm)


def _forward_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every forward of this process raises before its first layer."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise ForwardFault("injected: the forward failed")

    monkeypatch.setattr(GPUModelRunner, "_model_forward", failing)


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "negative_control"])
def test_a_forward_that_raises_stores_none_of_its_blocks(
    guarded: bool, model: Any, reference: RequestResult, pool_settings: Any, pool_client: Any
) -> None:
    config = transfer_config(pool_settings, **PATIENT_DEADLINES)
    with pytest.MonkeyPatch.context() as patch:
        if not guarded:
            import kvpool.connector.connector as connector_module

            patch.setattr(connector_module, "forward_raised", lambda: False)
        a = create_llm(EngineOptions(model=str(model), kv_transfer_config=config, dtype="float32"))
        try:
            keyspace = scheduler_connector(a).keyspace
            with pytest.MonkeyPatch.context() as forward:
                _forward_fails(forward)
                with pytest.raises(ForwardFault):
                    generate(a, [P1], MAX_TOKENS)
            saves = [t for t in worker_connector().recording.transfers if t.operation == "save"]
        finally:
            shutdown_llm(a)  # drains every save still in flight

    keys = pool_keys(keyspace, P1, GROUPS)
    stored = sum(1 for key in keys if raw_store(pool_client).is_exist(key) == 1)
    b = create_llm(EngineOptions(model=str(model), kv_transfer_config=config, dtype="float32"))
    try:
        served = generate(b, [P1], MAX_TOKENS, logprobs=True)[0]
    finally:
        shutdown_llm(b)

    if guarded:
        assert stored == 0, f"{stored} of {len(keys)} keys of a failed forward's blocks were stored"
        # Each save is recorded as not made, for that reason, with no block moved.
        assert saves and all(set(t.failures) == {"forward_failed"} and not any(t.blocks) for t in saves), [
            (t.blocks, t.failures) for t in saves
        ]
        assert (served.num_cached_tokens or 0) == 0, "B found nothing of P1 to load"
        assert served.token_ids == reference.token_ids
    else:
        assert stored > 0, "the control stores the failed forward's blocks"
        assert (served.num_cached_tokens or 0) >= PREFIX_HIT, served.num_cached_tokens
        differs = served.token_ids != reference.token_ids or any(
            abs(x - y) > 1e-3 for x, y in zip(served.logprobs or [], reference.logprobs or [], strict=True)
        )
        assert differs, "B's output, computed on the loaded blocks, matches the reference"
