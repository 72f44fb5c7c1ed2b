"""A failed load leaves nothing of its objects in the blocks vLLM hands to the next request.

vLLM's CPU attention reads a request's last block whole, the slots the request has not
written too, and masks them after the product: finite bytes there are harmless, NaN or
Inf turn the answer into token 0s (the first test shows both, without any pool). A
failed load's blocks go back to the free queue and a later request writes only the slots
it computes. So a loader that copies an object into its block before checking it (on the
host, a CRC-32C payload is checked on the block right after its copy) must leave nothing
of a payload that failed there: a corrupted object's random bytes hold NaN and Inf.

Here, on a real engine with a real pool, through the staging buffer and straight from the
engine's own segment: P1's prefix objects get NaN payloads under their own headers (their
checks fail); R (P2) loads them and is aborted after the failure; R's blocks must be
finite, and T, a prompt of its own sized so that its last, partly written block is one
R's load wrote, must answer what an engine without any cache answers.
"""

from __future__ import annotations

import ctypes
import random
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from kvpool.connector.contract.object_header import HEADER_BYTES
from testing.engine import (
    EngineOptions,
    create_llm,
    engine_core,
    generate,
    output_difference,
    sampling_params,
    scheduler_connector,
    shutdown_llm,
    transfer_config,
    worker_connector,
    worker_of,
)
from testing.models import build_gemma3_full
from testing.pool_store import put_bytes, raw_store
from testing.prompts import BLOCK, P1, P2, PREFIX, pool_keys

pytestmark = [pytest.mark.faults, pytest.mark.engine, pytest.mark.mooncake, pytest.mark.timeout(600)]

MAX_TOKENS = 8
#: Few blocks, so that the blocks of R's load come back to the head of the free queue soon.
NUM_BLOCKS = 24
MAX_MODEL_LEN = 640
STEP_DEADLINE_S = 60.0
NAN32 = struct.pack("<f", float("nan"))


@pytest.fixture(scope="module")
def single_group(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3_full(tmp_path_factory.mktemp("gemma3-full-leftovers"))


def _options(model: Path, **kwargs: Any) -> EngineOptions:
    return EngineOptions(
        model=str(model),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        llm_kwargs={"num_gpu_blocks_override": NUM_BLOCKS},
        **kwargs,
    )


def _kv_caches(llm: Any) -> list[Any]:
    """The engine's KV-cache tensors, blocks first (in-process CPU engine)."""
    (caches,) = llm.collective_rpc(lambda worker: list(worker.model_runner.kv_caches))
    return caches


def _fill_caches(llm: Any, value: float) -> None:
    for tensor in _kv_caches(llm):
        tensor.fill_(value)


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def test_unwritten_slots_reach_the_answer_only_when_not_finite(single_group: Path) -> None:
    """The hazard, without any pool: every block filled with a value, then prompts that end
    mid-block. Zero or a large finite value leave the answers as they were; NaN or Inf
    change them (so a failed load must leave no payload bytes, and zeroing is enough)."""
    prompts = [_prompt(40, 1), _prompt(70, 2)]
    llm = create_llm(_options(single_group, enable_prefix_caching=False))
    try:
        want = generate(llm, prompts, MAX_TOKENS, logprobs=True)
        for value in (0.0, 1e4, float("nan"), float("inf")):
            _fill_caches(llm, value)
            got = generate(llm, prompts, MAX_TOKENS, logprobs=True)
            problems = [output_difference(g, w) for g, w in zip(got, want, strict=True)]
            if value == value and abs(value) < float("inf"):
                assert problems == [None, None], f"unwritten slots of {value} changed the answer"
            else:
                assert all(problems), f"unwritten slots of {value} left the answer as it was"
    finally:
        shutdown_llm(llm)


def _step_until(engine: Any, done: Any) -> None:
    deadline = time.monotonic() + STEP_DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, "the engine made no progress before its deadline"
        engine.step()


def _nan_payload(stored_bytes: int) -> bytes:
    return NAN32 * ((stored_bytes - HEADER_BYTES) // len(NAN32))


def _replace_in_pool(pool_client: Any, keys: list[str]) -> None:
    """Each object: its own header over a NaN payload, put anew (in the store process)."""
    stored = {key: raw_store(pool_client).get(key) for key in keys}
    assert all(len(data) > HEADER_BYTES for data in stored.values()), "P1's prefix is stored"
    pool_client.remove(keys)
    for key, data in stored.items():
        assert put_bytes(pool_client, key, data[:HEADER_BYTES] + _nan_payload(len(data))) == 0


def _replace_in_own_segment(worker: Any, keys: list[str]) -> None:
    """Each object in the engine's own segment gets a NaN payload in place (memory gone bad)."""
    found = [at for at in worker.client.own_objects(keys) if at is not None]
    assert len(found) == len(keys), "the engine keeps its saves in its own segment"
    for address, size in found:
        payload = _nan_payload(size)
        ctypes.memmove(address + HEADER_BYTES, payload, len(payload))


@pytest.mark.parametrize("path", ["staged", "direct"])
def test_blocks_of_a_failed_load_hold_no_payload_byte(
    single_group: Path, pool_settings: Any, pool_client: Any, path: str
) -> None:
    """``staged``: read through the staging buffer, copied, checked on the block. ``direct``:
    from the engine's own segment straight into the block, checked there."""
    own_segment = {"global_segment_size": "64MB"} if path == "direct" else {}
    config = transfer_config(pool_settings, **own_segment)
    llm = create_llm(_options(single_group, kv_transfer_config=config))
    try:
        generate(llm, [P1], MAX_TOKENS)  # P1's blocks reach the pool
        worker = worker_of(llm)
        worker.wait_for_saves()
        engine = llm.llm_engine
        assert engine.reset_prefix_cache()  # only the pool has P1
        connector = scheduler_connector(llm)
        keys = pool_keys(connector.keyspace, PREFIX, len(connector.layout.groups))
        if path == "direct":
            _replace_in_own_segment(worker, keys)
        else:
            _replace_in_pool(pool_client, keys)

        recording = worker_connector().recording
        loads_before = len([t for t in recording.transfers if t.operation == "load"])
        scheduler = engine_core(llm).scheduler
        engine.add_request("R", {"prompt_token_ids": P2}, sampling_params(MAX_TOKENS))
        (request,) = scheduler.requests.values()  # vLLM's own id for R

        def loads() -> list[Any]:
            return [t for t in recording.transfers if t.operation == "load"][loads_before:]

        _step_until(engine, lambda: any(t.failures for t in loads()))
        (load,) = loads()
        assert load.failures == {"corrupt": len(keys)}, "every payload failed its check"
        assert load.direct_blocks == (len(keys) if path == "direct" else 0), path
        (r_blocks,) = scheduler.kv_cache_manager.get_block_ids(request.request_id)
        loaded = r_blocks[: len(PREFIX) // BLOCK]
        assert len(loaded) == len(PREFIX) // BLOCK, "R's blocks are allocated"
        for tensor in _kv_caches(llm):
            assert tensor[loaded].isfinite().all(), "a byte of a failed payload is in R's blocks"
        engine.abort_request(["R"])
        assert request.is_finished(), "R was aborted"

        # T: its own tokens (no hit anywhere), its last block, partly written, one of R's.
        queue = scheduler.kv_cache_manager.block_pool.free_block_queue
        free = [b.block_id for b in queue.get_all_free_blocks()]
        last = min(free.index(b) for b in loaded)
        prompt = _prompt(last * BLOCK + BLOCK // 2, 3)
        (got,) = generate(llm, [prompt], MAX_TOKENS, logprobs=True)
    finally:
        shutdown_llm(llm)

    reference = create_llm(_options(single_group, enable_prefix_caching=False))
    try:
        (want,) = generate(reference, [prompt], MAX_TOKENS, logprobs=True)
    finally:
        shutdown_llm(reference)
    assert got.num_cached_tokens in (0, None), "T has no hit: its blocks come from the free queue"
    problem = output_difference(got, want)
    assert problem is None, f"T, on R's blocks after R's failed load: {problem}"
