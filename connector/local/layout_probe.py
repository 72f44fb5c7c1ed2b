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

import contextlib
import multiprocessing
import os
import queue as queue_module
import shutil
import tempfile
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from kvpool.connector.contract.layout import KVLayout
from kvpool.connector.local.ports import held_port, release_port
from kvpool.connector.local.process_group import SHARED_MEMORY
from kvpool.connector.local.stopping import deferred
from kvpool.connector.local.watchdog import release, watch

LOOPBACK = "127.0.0.1"
RANK_TIMEOUT_S = 600.0
#: Memory offered to vLLM's KV-cache sizing: large enough for any ``max_model_len``;
#: nothing is allocated, and the layout does not depend on the number of blocks.
NOTIONAL_KV_MEMORY = 1 << 40


#: What the ranks' vLLM writes in the temporary folder (ZMQ IPC sockets of its message
#: queues, rendezvous files): pointed at a folder of the probe's own, removed with it.
RANK_TEMP_VARIABLES = ("VLLM_RPC_BASE_PATH", "TMPDIR")
#: The longest path of a Unix socket (``sockaddr_un.sun_path``, less its final NUL).
SOCKET_PATH_MAX = 107
#: vLLM names its IPC sockets with a UUID (36 characters) in its folder.
SOCKET_NAME_LENGTH = 36


class ProbeError(RuntimeError):
    """The layout could not be computed; the message says why."""


class UnsupportedBlockSize(ProbeError):
    """The attention backends of this platform cannot run the block size asked for."""


def engine_arg_names() -> set[str]:
    """The field names of vLLM's ``EngineArgs``."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return {field.name for field in dataclasses.fields(EngineArgs)}


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
            backends: dict[str, Any] = {}
            layers = get_layers_from_vllm_config(config, AttentionLayerBase)  # type: ignore[type-abstract]
            for name, layer in layers.items():
                if isinstance(layer, Attention) and layer.kv_sharing_target_layer_name:
                    continue  # shares another layer's KV cache: no cache of its own
                spec = layer.get_kv_cache_spec(config)
                if spec is None:
                    continue
                backends[name] = layer.get_attn_backend()
                if isinstance(spec, AttentionSpec):
                    spec = customize_attention_spec(backends[name], spec)
                specs[name] = spec
            layouts = [
                layout.name for layout in get_supported_kv_cache_layouts(get_current_attn_backends(config))
            ]
            destroy_model_parallel()
            destroy_distributed_environment()
        out.put((rank, specs, backends, layouts, None))
    except BaseException as exc:  # reported to the parent, which names it
        out.put((rank, None, None, None, f"{type(exc).__name__}: {exc}"))


def rank_specs(
    engine_args: Mapping[str, Any], world: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """Every rank's KV-cache specs and attention backends by layer (in rank order), and the
    layouts the backends support. The ranks' temporary files go in a folder of their own,
    removed with whatever they left there once they are stopped."""
    context = multiprocessing.get_context("spawn")
    results: Any = context.Queue()
    port = held_port()  # rank 0 binds it once its interpreter is up: held until the probe ends
    rank_temp = _rank_temp_folder()
    # vLLM's CPU communicator names its shared-memory segments after VLLM_DIST_IDENT (its CPU
    # worker sets it from the init method's port): named after this probe, a rank stopped
    # before it unlinks its own leaves them where the probe finds them, and only them.
    shm_ident = f"kvpool-layout-{os.getpid()}-{port}"
    env = {
        "VLLM_HOST_IP": LOOPBACK,
        "VLLM_DIST_IDENT": shm_ident,
        **dict.fromkeys(RANK_TEMP_VARIABLES, rank_temp),
    }
    env_before = {k: os.environ.get(k) for k in (*env, "GLOO_SOCKET_IFNAME")}
    os.environ.update(env)  # gloo's peers meet on loopback; the ranks inherit it at their start
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    processes = [
        context.Process(target=_rank_specs, args=(dict(engine_args), rank, port, results), daemon=True)
        for rank in range(world)
    ]
    collected: dict[int, tuple[dict[str, Any], dict[str, Any], list[str]]] = {}
    try:
        for process in processes:
            process.start()
            watch(process)  # a SIGKILLed probe takes its ranks (and their shared memory) with it
        for key, value in env_before.items():  # the ranks have their environment
            _restore(key, value)
        while len(collected) < world:
            try:
                rank, specs, backends, layouts, error = results.get(timeout=RANK_TIMEOUT_S)
            except queue_module.Empty:
                raise ProbeError(f"no answer from the model's ranks after {RANK_TIMEOUT_S:.0f}s") from None
            if error is not None:
                raise ProbeError(f"rank {rank} could not build the model's KV-cache specs: {error}")
            collected[rank] = (specs, backends, layouts)
    finally:
        with deferred():  # a stop signal meanwhile is raised once the ranks and their files are gone
            for process in processes:
                if len(collected) < world and process.is_alive():
                    process.kill()  # a failed or stopped probe: the others may wait on it forever
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
                    process.join()
                release(process)
            for key, value in env_before.items():
                _restore(key, value)
            shutil.rmtree(rank_temp, ignore_errors=True)
            _remove_shared_memory(shm_ident)
            release_port(port)
    ordered = [collected[r] for r in range(world)]
    return [c[0] for c in ordered], [c[1] for c in ordered], ordered[0][2]


def _rank_temp_folder() -> str:
    """A new folder for the ranks' temporary files: in the temporary folder, else in /tmp
    where that one is too deep for the paths of the sockets vLLM makes in it."""
    for parent in (None, "/tmp"):
        folder = tempfile.mkdtemp(prefix="kvpool-layout-", dir=parent)
        if len(folder) + 1 + SOCKET_NAME_LENGTH <= SOCKET_PATH_MAX:
            return folder
        os.rmdir(folder)
    raise ProbeError(f"no temporary folder short enough for vLLM's IPC sockets: {folder}")


def _remove_shared_memory(ident: str, folder: str = SHARED_MEMORY) -> None:
    """The shared-memory segments of the ranks' CPU communicator (``IDENT-…-cpushm_RANK``) that
    stopped ranks left: each rank unlinks its own only when it ends its group itself."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if name.startswith(f"{ident}-") and "-cpushm" in name:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))


def _restore(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def check_kernel_block_sizes(
    configs: list[Any], specs: list[dict[str, Any]], backends: list[dict[str, Any]]
) -> None:
    """Refuse a block size the attention backends cannot split into their kernels' blocks, as
    each rank's vLLM worker does (``prepare_kernel_block_sizes``) before it allocates its cache."""
    from vllm.v1.worker.utils import prepare_kernel_block_sizes

    for config, rank_specs_, rank_backends in zip(configs, specs, backends, strict=True):
        attn_groups: list[list[SimpleNamespace]] = []
        for group in config.kv_cache_groups:
            members: list[SimpleNamespace] = []
            for name in group.layer_names:
                if name not in rank_backends:
                    continue
                member = SimpleNamespace(backend=rank_backends[name], kv_cache_spec=rank_specs_[name])
                if member not in members:
                    members.append(member)
            attn_groups.append(members)
        try:
            prepare_kernel_block_sizes(config, attn_groups)  # type: ignore[arg-type]
        except ValueError as exc:
            if "block size" not in str(exc):  # not the refusal this check is for: say so, whole
                raise ProbeError(f"vLLM's kernel block size check failed: {exc}") from exc
            raise UnsupportedBlockSize(str(exc)) from None


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
    specs, backends, layouts = rank_specs(
        engine_args, parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    )
    if not any(specs):
        raise ProbeError("the model has no layer with a KV cache: there is nothing to pool")
    with set_current_vllm_config(config):
        register_all_kvcache_specs(config)
        resolve_kv_cache_layout(config, [layouts] * len(specs), [s for r in specs for s in r.values()])
        configs = get_kv_cache_configs(config, specs, [kv_memory_bytes] * len(specs))
        check_kernel_block_sizes(configs, specs, backends)
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
