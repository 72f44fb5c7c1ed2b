"""The KV layout vLLM builds for a model, computed without weights or a KV cache.

Each rank of the requested TP x PP world runs in a process of its own: it builds
the model's modules on PyTorch's ``meta`` device (no memory, no weights) under
vLLM's own config, parallel state and attention backends, and collects each
layer's KV-cache spec the way vLLM's model runner does. The parent then does
what vLLM's engine core does with those specs (layout resolution,
``get_kv_cache_configs``, the block-size bookkeeping) and turns the result into
the contract's :class:`~kvpool.connector.contract.layout.KVLayout` with the
connector's own :func:`~kvpool.connector.vllm_layout.layout_from_vllm`. So the
layout is the one a vLLM server with the same flags, on the same platform,
hands the connector.

Needs vLLM (and torch); everything it starts talks over 127.0.0.1 and is
stopped before it returns.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
from collections.abc import Mapping
from typing import Any

from kvpool.connector.contract.layout import KVLayout
from kvpool.connector.local.ports import free_port

LOOPBACK = "127.0.0.1"
RANK_TIMEOUT_S = 600.0
#: Memory offered to vLLM's KV-cache sizing: large enough for any ``max_model_len``;
#: nothing is allocated, and the layout does not depend on the number of blocks.
NOTIONAL_KV_MEMORY = 1 << 40


class ProbeError(RuntimeError):
    """The layout could not be computed; the message says why."""


def engine_config(engine_args: Mapping[str, Any]) -> Any:
    """vLLM's ``VllmConfig`` for ``engine_args`` (``EngineArgs`` field names), tokenizer skipped."""
    from vllm.engine.arg_utils import EngineArgs

    args = {"skip_tokenizer_init": True, "enforce_eager": True, **engine_args}
    return EngineArgs(**args).create_engine_config()


def _rank_specs(engine_args: dict[str, Any], rank: int, port: int, out: Any) -> None:
    """In a rank's process: the model's modules on ``meta``, and each layer's KV-cache spec."""
    try:
        import torch
        from vllm.config import get_layers_from_vllm_config, set_current_vllm_config
        from vllm.distributed import (
            destroy_distributed_environment,
            destroy_model_parallel,
            init_distributed_environment,
            initialize_model_parallel,
        )
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
        from vllm.model_executor.layers.attention import Attention
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
        from vllm.v1.kv_cache_interface import AttentionSpec
        from vllm.v1.worker.utils import customize_attention_spec

        config = engine_config(engine_args)
        parallel = config.parallel_config
        world = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        # vLLM's CPU communicator names its shared-memory segments after this; vLLM's CPU
        # worker sets it from the init method's port before it joins the group.
        os.environ["VLLM_DIST_IDENT"] = str(port)
        with set_current_vllm_config(config):
            init_distributed_environment(
                world_size=world,
                rank=rank,
                distributed_init_method=f"tcp://{LOOPBACK}:{port}",
                local_rank=rank,
                backend="gloo",
            )
            initialize_model_parallel(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
            with torch.device("meta"):
                initialize_model(vllm_config=config)
            specs: dict[str, Any] = {}
            layers = get_layers_from_vllm_config(config, AttentionLayerBase)  # type: ignore[type-abstract]
            for name, layer in layers.items():
                if isinstance(layer, Attention) and layer.kv_sharing_target_layer_name:
                    continue  # shares another layer's KV cache: no cache of its own
                spec = layer.get_kv_cache_spec(config)
                if spec is None:
                    continue
                if isinstance(spec, AttentionSpec):
                    spec = customize_attention_spec(layer.get_attn_backend(), spec)
                specs[name] = spec
            layouts = [
                layout.name for layout in get_supported_kv_cache_layouts(get_current_attn_backends(config))
            ]
            destroy_model_parallel()
            destroy_distributed_environment()
        out.put((rank, specs, layouts, None))
    except BaseException as exc:  # reported to the parent, which names it
        out.put((rank, None, None, f"{type(exc).__name__}: {exc}"))


def rank_specs(engine_args: Mapping[str, Any], world: int) -> tuple[list[dict[str, Any]], list[str]]:
    """Every rank's KV-cache specs (in rank order) and the layouts the backends support."""
    context = multiprocessing.get_context("spawn")
    results: Any = context.Queue()
    port = free_port()
    env_before = {k: os.environ.get(k) for k in ("VLLM_HOST_IP", "GLOO_SOCKET_IFNAME")}
    os.environ["VLLM_HOST_IP"] = LOOPBACK  # gloo's peers meet on loopback
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    processes = [
        context.Process(target=_rank_specs, args=(dict(engine_args), rank, port, results), daemon=True)
        for rank in range(world)
    ]
    try:
        for process in processes:
            process.start()
        collected: dict[int, tuple[dict[str, Any], list[str]]] = {}
        while len(collected) < world:
            try:
                rank, specs, layouts, error = results.get(timeout=RANK_TIMEOUT_S)
            except queue_module.Empty:
                raise ProbeError(f"no answer from the model's ranks after {RANK_TIMEOUT_S:.0f}s") from None
            if error is not None:
                raise ProbeError(f"rank {rank} could not build the model's KV-cache specs: {error}")
            collected[rank] = (specs, layouts)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        for key, value in env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return [collected[r][0] for r in range(world)], collected[0][1]


def kv_cache_configs(
    engine_args: Mapping[str, Any], kv_memory_bytes: int = NOTIONAL_KV_MEMORY
) -> tuple[Any, list[Any], Any]:
    """vLLM's config, every rank's ``KVCacheConfig`` (rank order) and the scheduler's, as its
    engine core computes them for ``engine_args`` with ``kv_memory_bytes`` per rank."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_configs,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    config = engine_config(engine_args)
    parallel = config.parallel_config
    specs, layouts = rank_specs(engine_args, parallel.tensor_parallel_size * parallel.pipeline_parallel_size)
    if not any(specs):
        raise ProbeError("the model has no layer with a KV cache: there is nothing to pool")
    with set_current_vllm_config(config):
        register_all_kvcache_specs(config)
        resolve_kv_cache_layout(config, [layouts] * len(specs), [s for r in specs for s in r.values()])
        configs = get_kv_cache_configs(config, specs, [kv_memory_bytes] * len(specs))
        scheduler_config = generate_scheduler_kv_cache_config(configs)
        groups = scheduler_config.kv_cache_groups
        cacheable = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
        config.cache_config.block_size = min(cacheable or [g.kv_cache_spec.block_size for g in groups])
        _, hash_block_size = resolve_kv_cache_block_sizes(scheduler_config, config)
        scheduler_config.hash_block_size = hash_block_size
    return config, configs, scheduler_config


def probe_layout(engine_args: Mapping[str, Any], model_id: str = "") -> KVLayout:
    """The layout a vLLM server started with ``engine_args`` hands the connector."""
    from vllm.config import set_current_vllm_config

    from kvpool.connector.vllm_layout import layout_from_vllm

    config, _, scheduler_config = kv_cache_configs(engine_args)
    with set_current_vllm_config(config):
        return layout_from_vllm(config, scheduler_config, model_id)
