"""A real vLLM ``Scheduler`` with ``KVPoolConnector`` loaded by module path."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tests.vllm_specs import GroupDesc, block_sizes, ensure_registry, make_kv_cache_config

_ids = itertools.count()


def engine_config(model_dir: Path, extra_config: dict[str, Any], kv_role: str = "kv_both") -> Any:
    args = EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,
        block_size=32,
        max_model_len=4096,
        enable_prefix_caching=True,
        enforce_eager=True,
        dtype="float32",
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVPoolConnector",
            kv_connector_module_path="kvpool.connector",
            kv_role=kv_role,
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra_config,
        ),
    )
    return args.create_engine_config()


def make_scheduler(
    model_dir: Path, groups: list[GroupDesc], extra_config: dict[str, Any], kv_role: str = "kv_both"
) -> Scheduler:
    ensure_registry()
    vllm_config = engine_config(model_dir, extra_config, kv_role)
    kv_cache_config = make_kv_cache_config(groups, num_blocks=2048)
    scheduler_block, hash_block = block_sizes(groups)
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=scheduler_block,
        hash_block_size=hash_block,
        log_stats=True,
    )


def make_request(scheduler: Scheduler, prompt: list[int]) -> Request:
    hash_block = scheduler.kv_cache_manager.block_pool.hash_block_size
    init_none_hash(get_hash_fn_by_name("sha256"))
    return Request(
        request_id=f"req-{next(_ids)}",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=4, temperature=0.0),
        pooling_params=None,
        block_hasher=get_request_block_hasher(hash_block, get_hash_fn_by_name("sha256")),
    )
