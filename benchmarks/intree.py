"""vLLM's in-tree ``MooncakeStoreConnector`` (0.32), run the way vLLM runs it.

Its scheduler half (``MooncakeStoreScheduler``) does not talk to Mooncake: each
lookup goes over ZMQ (IPC) to a ``LookupKeyServer`` that the worker of rank 0
starts, which runs ``batch_is_exist`` and the hybrid hit there. vLLM puts that
worker in the engine-core process for one GPU (``UniProcExecutor``) and in a
worker process of its own with ``MultiprocExecutor``; both are offered here:

* :func:`start_worker` — the worker connector in this process (the server is a thread);
* :class:`WorkerProcess` — the worker connector in a spawned process.

The scheduler half is created by a real ``Scheduler`` (see ``vllm_env``).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.vllm_env import bench_engine_config
from kvpool.connector.contract.mooncake_env import CONFIG_PATH_ENV
from kvpool.connector.local.ports import free_port
from testing.kv_cache import GroupDesc, make_kv_cache_config

_dist_ready = False


def write_mooncake_config(path: Path, pool_address: str) -> Path:
    """The ``MOONCAKE_CONFIG_PATH`` file: TCP on loopback, memory held by the pool's store."""
    path.write_text(
        json.dumps(
            {
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": pool_address,
                "protocol": "tcp",
                "device_name": "",
                "mode": "standalone-store",
                "global_segment_size": 0,
                "local_buffer_size": 16 << 20,
            }
        )
    )
    return path


def intree_transfer(cache_prefix: str, rpc_port: int) -> dict[str, Any]:
    """``KVTransferConfig`` fields for the in-tree connector (lookups on ``rpc_port``'s IPC socket)."""
    return {
        "kv_connector": "MooncakeStoreConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cache_prefix": cache_prefix, "lookup_rpc_port": rpc_port},
    }


def init_single_rank(vllm_config: Any) -> None:
    """vLLM's distributed groups for world size 1 (gloo on loopback), once per process."""
    global _dist_ready
    if _dist_ready:
        return
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            local_rank=0,
            backend="gloo",
        )
        ensure_model_parallel_initialized(1, 1)
    _dist_ready = True


def teardown_single_rank() -> None:
    global _dist_ready
    if _dist_ready:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
        _dist_ready = False


@contextmanager
def mooncake_config_env(config_path: Path) -> Iterator[None]:
    """``MOONCAKE_CONFIG_PATH`` set only while the in-tree worker starts.

    Only the in-tree worker reads it; KVPoolConnector would read it too, and
    rejects the in-tree file's ``mode`` key (see the benchmark README).
    """
    old = os.environ.get(CONFIG_PATH_ENV)
    os.environ[CONFIG_PATH_ENV] = str(config_path)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(CONFIG_PATH_ENV, None)
        else:
            os.environ[CONFIG_PATH_ENV] = old


def start_worker(
    model_dir: Path, groups: list[GroupDesc], transfer: dict[str, Any], num_blocks: int, config_path: Path
) -> Any:
    """The in-tree connector's worker half in this process; rank 0 starts the lookup server."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
        MooncakeStoreConnector,
    )

    vllm_config = bench_engine_config(model_dir, transfer)
    kv_cache_config = make_kv_cache_config(groups, num_blocks)
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    init_single_rank(vllm_config)
    with set_current_vllm_config(vllm_config), mooncake_config_env(config_path):
        return MooncakeStoreConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)


def intree_keys(worker_connector: Any, block_hashes: list[Any], counts: list[int]) -> list[str]:
    """The keys the in-tree lookup asks about for the first ``counts[g]`` blocks of each group."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import PoolKey

    worker = worker_connector.connector_worker
    keys: list[str] = []
    for g, count in enumerate(counts):
        spec = worker._kv_cache_groups[g].kv_cache_spec
        hashes = worker.coord.block_hashes_for_spec(block_hashes, spec)
        for i in range(min(count, len(hashes))):
            for prefix in worker._lookup_key_prefixes[g]:
                keys.append(PoolKey.build_key_string(prefix, hashes[i].hex()))
    return keys


def _worker_main(spec: dict[str, Any], conn: Any) -> None:
    """Child process: run the in-tree worker half until told to stop."""
    import benchmarks  # noqa: F401  (the environment, before vLLM loads)

    connector = None
    try:
        groups = [GroupDesc(**g) for g in spec["groups"]]
        connector = start_worker(
            Path(spec["model_dir"]), groups, spec["transfer"], spec["num_blocks"], Path(spec["config_path"])
        )
        conn.send("ready")
        conn.recv()
    except Exception as exc:  # report, then exit
        conn.send(f"error: {exc!r}")
    finally:
        if connector is not None:
            connector.shutdown()
        conn.close()


class WorkerProcess:
    """The in-tree worker half in a process of its own (as ``MultiprocExecutor`` runs it)."""

    def __init__(
        self,
        model_dir: Path,
        groups: list[GroupDesc],
        transfer: dict[str, Any],
        num_blocks: int,
        config_path: Path,
    ):
        self.spec = {
            "config_path": str(config_path),
            "model_dir": str(model_dir),
            "groups": [asdict(g) for g in groups],
            "transfer": transfer,
            "num_blocks": num_blocks,
        }
        self._conn: Any = None
        self._process: Any = None

    def __enter__(self) -> WorkerProcess:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_worker_main, args=(self.spec, child), daemon=True)
        self._process.start()
        child.close()
        if not self._conn.poll(180):
            self.stop()
            raise TimeoutError("in-tree worker process did not start")
        status = self._conn.recv()
        if status != "ready":
            self.stop()
            raise RuntimeError(f"in-tree worker process failed: {status}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._process is None:
            return
        with suppress(BrokenPipeError, OSError):
            self._conn.send("stop")
        self._process.join(30)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()
        self._process = None
