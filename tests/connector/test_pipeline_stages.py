"""Pipeline parallel: two stages store a prompt, two fresh stages load it byte for byte.

vLLM 0.32's CPU engine cannot run PP=2 here (KeyError in its engine core), so the
engine is assembled from its real parts instead: each stage's ``KVCacheConfig`` from
vLLM's own ``get_kv_cache_configs`` over the stages' real layer specs (the layout
probe builds each rank's model on ``meta``), vLLM's real ``Scheduler`` (which starts the
scheduler-side connector from stage 0's config, as the engine core does), one real
worker-side connector per stage, vLLM's own ``KVOutputAggregator`` across the
stages, and a real Mooncake master and store. What stands in for the model runner is
the forward itself: each stage's KV tensors hold random bytes, so a load is checked
against the bytes the storing stage held.

The split ``2,4`` over the tiny Gemma3's layers (sliding, sliding, full, ...) puts no
full-attention layer on stage 0: that group has no layers there.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest

from testing.engine import worker_of
from testing.prompts import hashed_request
from testing.scheduler import local_pool_transfer, scheduler_over

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(600)]

LAYER_PARTITION = "2,4"
BLOCK = 32
PROMPT = 300
KV_MEMORY = 8 << 20  # per stage: a few hundred blocks
PREFILL_BOUND_S = 120  # against a stuck lookup or load, not a speed target
_ids = itertools.count()


@pytest.fixture(scope="module")
def stage_configs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, list[Any], Any]]:
    """vLLM's config, each stage's ``KVCacheConfig`` and the scheduler's, for PP=2."""
    from testing.kv_cache import pipeline_stage_configs
    from testing.models import build_gemma3

    model = build_gemma3(tmp_path_factory.mktemp("pp") / "gemma3-6", num_hidden_layers=6)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_PP_LAYER_PARTITION", LAYER_PARTITION)
        yield pipeline_stage_configs(model, BLOCK, KV_MEMORY)


class Stage:
    """One pipeline stage's worker-side connector over KV tensors of its own."""

    def __init__(self, config: Any, kv_cache_config: Any, pp_rank: int, seed: int | None):
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        import kvpool.connector.connector as connector_module

        self.kv_cache_config = kv_cache_config
        generator = torch.Generator().manual_seed(seed or 0)
        self.kv: dict[str, Any] = {}
        for group in kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            shape = (2, kv_cache_config.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
            for name in group.layer_names:
                tensor = torch.randn(shape, generator=generator) if seed is not None else torch.zeros(shape)
                self.kv[name] = tensor.to(spec.dtype)
        with pytest.MonkeyPatch.context() as patch, set_current_vllm_config(config):
            patch.setattr(connector_module, "_ranks", lambda: (0, pp_rank))
            self.connector = connector_module.KVPoolConnector(config, KVConnectorRole.WORKER, kv_cache_config)
        self.connector.register_kv_caches(self.kv)

    def step(self, scheduler_output: Any) -> Any:
        """What the model runner does around one forward (``_get_kv_connector_output``)."""
        from vllm.v1.outputs import KVConnectorOutput

        connector = self.connector
        connector.handle_preemptions(scheduler_output.kv_connector_metadata)
        connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        connector.start_load_kv(None)
        connector.wait_for_save()
        results = connector.get_transfer_results(scheduler_output.finished_req_ids)
        output = KVConnectorOutput(
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=connector.get_block_ids_with_load_errors(),
        )
        connector.clear_connector_metadata()
        return output

    def drain(self) -> None:
        """Every save of this stage has returned."""
        assert worker_of(self.connector).shutdown(), "a save of this stage is stuck"

    def block_bytes(self, layer: str, block_id: int) -> bytes:
        return self.kv[layer][:, block_id].contiguous().view(-1).numpy().tobytes()


class Engine:
    """vLLM's scheduler and one worker per stage, stepped as the engine core steps them."""

    def __init__(self, stage_configs: tuple[Any, list[Any], Any], pool_settings: Any, *, seed: int | None):
        from vllm.config import KVTransferConfig, set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        config, per_stage, scheduler_config = stage_configs
        config.kv_transfer_config = KVTransferConfig(**local_pool_transfer(pool_settings))
        self.stages = [
            Stage(config, c, rank, None if seed is None else seed + rank) for rank, c in enumerate(per_stage)
        ]
        with set_current_vllm_config(config):
            self.scheduler = scheduler_over(config, scheduler_config, BLOCK, BLOCK)
        self.aggregator = KVOutputAggregator(expected_finished_count=len(self.stages))

    def step(self) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        output = self.scheduler.schedule()
        # Workers tell an idle step (no forward: they may pause for loads) by this.
        assert output.kv_connector_metadata.forward_tokens == output.total_num_scheduled_tokens
        req_ids = list(output.num_scheduled_tokens)
        runs = [
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[[7] for _ in req_ids],
                kv_connector_output=stage.step(output),
            )
            for stage in self.stages
        ]
        self.scheduler.update_from_output(output, self.aggregator.aggregate(runs, output_rank=len(runs) - 1))
        return output

    def prefill(self, prompt: list[int]) -> tuple[Any, int]:
        """Admit and prefill ``prompt``; the request and the tokens it got from the pool."""
        from vllm.sampling_params import SamplingParams

        request = hashed_request(
            prompt,
            BLOCK,
            request_id=f"pp-{next(_ids)}",
            sampling_params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        )
        self.scheduler.add_request(request)
        computed_before = 0  # at its first scheduled step: what it got without computing
        deadline = time.monotonic() + PREFILL_BOUND_S
        while time.monotonic() < deadline:
            output = self.step()
            if not output.num_scheduled_tokens:
                time.sleep(0.01)  # a lookup or a load still in flight, as an idle engine loop waits
            for new in output.scheduled_new_reqs:
                if new.req_id == request.request_id:
                    computed_before = new.num_computed_tokens
            if request.num_computed_tokens >= len(prompt):
                return request, computed_before
        raise AssertionError(f"the prompt was not prefilled within {PREFILL_BOUND_S} s")

    def close(self) -> None:
        for stage in self.stages:
            stage.drain()
            stage.connector.shutdown()
        self.scheduler.shutdown()


def test_stages_store_and_fresh_stages_load_every_block(stage_configs, pool_settings) -> None:
    _, per_stage, _ = stage_configs
    full = [
        i
        for i, g in enumerate(per_stage[0].kv_cache_groups)
        if type(g.kv_cache_spec).__name__ == "FullAttentionSpec"
    ]
    assert full and all(not per_stage[0].kv_cache_groups[i].layer_names for i in full), (
        "the split should leave stage 0 without full-attention layers"
    )
    prompt = [(7 * i) % 500 + 3 for i in range(PROMPT)]
    writer = Engine(stage_configs, pool_settings, seed=1)
    try:
        stored, from_pool = writer.prefill(prompt)
        assert from_pool == 0
        written = writer.scheduler.kv_cache_manager.get_block_ids(stored.request_id)
        for stage in writer.stages:
            stage.drain()
    finally:
        writer.close()

    reader = Engine(stage_configs, pool_settings, seed=None)
    try:
        loaded, from_pool = reader.prefill([*prompt, 11, 12, 13])
        hit_blocks = PROMPT // BLOCK
        assert from_pool == hit_blocks * BLOCK
        read = reader.scheduler.kv_cache_manager.get_block_ids(loaded.request_id)
        compared = 0
        for rank, (source, target) in enumerate(zip(writer.stages, reader.stages, strict=True)):
            for group_id, group in enumerate(per_stage[rank].kv_cache_groups):
                spec = group.kv_cache_spec
                window = getattr(spec, "sliding_window", None)
                # A sliding window moves only the blocks of its window before the hit's end.
                first = max(0, hit_blocks - window // BLOCK) if window else 0
                for layer in group.layer_names:
                    for index in range(first, hit_blocks):
                        want = source.block_bytes(layer, written[group_id][index])
                        got = target.block_bytes(layer, read[group_id][index])
                        assert got == want, f"stage {rank} {layer} block {index} differs"
                        compared += 1
        assert compared > 0
    finally:
        reader.close()


def test_scheduler_and_stages_share_the_key_fingerprint(stage_configs, pool_settings) -> None:
    """Each stage sees its own layers; the keys of all three processes carry one fingerprint."""
    engine = Engine(stage_configs, pool_settings, seed=0)
    try:
        scheduler_keys = engine.scheduler.connector.keyspace.fingerprint
        assert {s.connector.keyspace.fingerprint for s in engine.stages} == {scheduler_keys}
    finally:
        engine.close()
