"""Pipeline stages never wait for each other inside the connector.

A later pipeline stage enters its step blocked in a receive of the earlier stage's
hidden states, before it calls any connector hook; the earlier stage meanwhile starts
the step's loads (``start_load_kv``). Any collective over the pipeline group there (an
agreement on failed loads, say) would wait for a stage that waits for it: a hang until
the process group's timeout, at the first step with a pool hit.

Two real processes in a real gloo group on loopback, as vLLM's PP=2 workers (vLLM's own
``init_distributed_environment`` and pipeline group), each with the real worker-side
``KVPoolConnector`` over its stage's real ``KVCacheConfig`` and a real Mooncake pool,
called in the stages' real order: stage 1 waits in ``recv_object`` while stage 0 runs
``start_load_kv``. Stage 1's object is missing from the pool, so its load fails while
stage 0's succeeds: vLLM's own ``KVOutputAggregator`` over both stages' outputs must
report the request finished with stage 1's failed block, which is how a stage's
failure reaches the scheduler (it then recomputes the block on every stage).

(vLLM 0.32's CPU engine cannot run PP=2 whole; see ``test_pipeline_stages.py``.)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool.connector.local.pool import LOOPBACK
from kvpool.connector.local.ports import held_port, release_port

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(300)]

BLOCK = 32
KV_MEMORY = 4 << 20
SAVED, LOADED = 1, 5  # the block each stage saves, and the block the load writes
DIGEST = "00" * 32
STEP_BOUND_S = 90.0  # against a hang: far above the few seconds a step takes here


@pytest.fixture(scope="module")
def stage_configs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, list[Any]]]:
    """vLLM's config and each stage's ``KVCacheConfig`` for PP=2 of an all-full-attention
    model (one KV-cache group: block-level load failures)."""
    from testing.kv_cache import pipeline_stage_configs
    from testing.models import build_gemma3_full

    model = build_gemma3_full(tmp_path_factory.mktemp("pp-full"))
    config, per_stage, _ = pipeline_stage_configs(model, BLOCK, KV_MEMORY)
    yield config, per_stage


def _stage(rank: int, port: int, config: Any, kv_cache_config: Any, transfer: dict, out: Any) -> None:
    """One pipeline stage: save a block, then (stage 1 in a receive first) load it elsewhere."""
    import torch
    from vllm.config import KVTransferConfig, set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        get_pp_group,
        init_distributed_environment,
    )
    from vllm.v1.outputs import KVConnectorOutput

    from kvpool.connector.connector import KVPoolConnector
    from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestLoad, RequestSave
    from testing.engine import worker_of

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["VLLM_DIST_IDENT"] = str(port)  # as vLLM's CPU worker sets it
    config.kv_transfer_config = KVTransferConfig(**transfer)
    with set_current_vllm_config(config):
        init_distributed_environment(2, rank, f"tcp://{LOOPBACK}:{port}", rank, backend="gloo")
        ensure_model_parallel_initialized(1, 2)
        connector = KVPoolConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    kv = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        shape = (2, kv_cache_config.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
        for name in group.layer_names:
            kv[name] = torch.randn(shape, generator=torch.Generator().manual_seed(rank)).to(spec.dtype)
    connector.register_kv_caches(kv)
    worker = worker_of(connector)

    def step(meta: PoolConnectorMetadata) -> None:
        connector.handle_preemptions(meta)
        connector.bind_connector_metadata(meta)
        connector.start_load_kv(None)
        connector.wait_for_save()
        connector.clear_connector_metadata()

    step(
        PoolConnectorMetadata(
            saves=[RequestSave("s", [GroupTransfer(0, [DIGEST], [SAVED])])], forward_tokens=1
        )
    )
    worker.wait_for_saves()
    if rank == 1:
        assert worker.client.remove([connector.keyspace.key(0, 0, 1, DIGEST)]) == [0]
    get_pp_group().barrier()

    load = PoolConnectorMetadata(
        loads=[RequestLoad("r", [GroupTransfer(0, [DIGEST], [LOADED])], hit_tokens=BLOCK)], forward_tokens=0
    )
    if rank == 1:
        get_pp_group().recv_object(src=0)  # stage 0's hidden states, before this stage's hooks
        step(load)
    else:
        step(load)  # where an agreement over the pipeline group would wait for stage 1
        get_pp_group().send_object({"hidden_states": "…"}, dst=1)
    finished: set[str] = set()
    failed: set[str] = set()
    invalid: set[int] = set()
    deadline = time.monotonic() + STEP_BOUND_S
    while "r" not in finished and time.monotonic() < deadline:
        results = connector.get_transfer_results(set())
        finished |= results.finished_recving or set()
        failed |= results.failed_recving or set()
        invalid |= connector.get_block_ids_with_load_errors()
        time.sleep(0.01)
    out.put(
        (rank, KVConnectorOutput(finished_recving=finished, failed_recving=failed, invalid_block_ids=invalid))
    )
    loaded_here = bool(torch.equal(kv[next(iter(kv))][:, LOADED], kv[next(iter(kv))][:, SAVED]))
    out.put((rank, loaded_here))
    connector.shutdown()


def test_a_stage_loads_while_the_next_waits_for_it_and_its_failure_reaches_vllm(
    stage_configs: tuple[Any, list[Any]], pool_settings: Any
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import ModelRunnerOutput

    from testing.scheduler import local_pool_transfer

    config, per_stage = stage_configs
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = held_port()  # stage 0's store binds it once its interpreter is up
    transfer = local_pool_transfer(pool_settings)
    procs = [
        ctx.Process(target=_stage, args=(rank, port, config, per_stage[rank], transfer, out))
        for rank in (0, 1)
    ]
    for proc in procs:
        proc.start()
    outputs: dict[int, Any] = {}
    loaded: dict[int, bool] = {}
    try:
        while len(loaded) < 2:
            try:
                rank, item = out.get(timeout=STEP_BOUND_S)
            except queue.Empty:
                pytest.fail(
                    f"no stage reported for {STEP_BOUND_S:.0f} s: stage 0's start_load_kv waits for "
                    "stage 1, which waits for stage 0's hidden states (a deadlock)"
                )
            if isinstance(item, bool):
                loaded[rank] = item
            else:
                outputs[rank] = item
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        release_port(port)
    assert loaded == {0: True, 1: False}, "stage 0 loaded its object; stage 1's was missing"
    # Both stages' outputs, aggregated as vLLM's executor aggregates its workers'.
    runs = [
        ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=outputs[rank])
        for rank in (0, 1)
    ]
    kv_output = (
        KVOutputAggregator(expected_finished_count=2).aggregate(runs, output_rank=1).kv_connector_output
    )
    assert kv_output is not None
    assert kv_output.finished_recving == {"r"}, "the load is finished once both stages reported it"
    assert kv_output.invalid_block_ids == {LOADED}, "stage 1's failed block reaches the scheduler"
