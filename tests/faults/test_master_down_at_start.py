"""A real engine started while its master is down: it starts at once and serves without the
pool (each lookup a counted ``rpc_failed``, ``vllm:kvpool_in_pool`` 0), then joins the pool
once the master serves, with the KV memory it registered before, and its hits load KV equal to
a run without the pool.

Before, the connector's setup failed after its RPC retries and the engine did not start:
every replica created during an outage of the pool crash-looped instead of serving.

At TP=2 the scheduler and each worker process hold a client of their own: each starts out
of the pool and joins on its own, and a hit (both ranks' objects, both ranks' loads) comes
once all three have.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.local.engine import run_module
from kvpool.connector.pool_attach import ATTACH_INTERVAL_S
from testing.engine import EngineOptions, engine_env, scheduler_connector, scheduler_of, transfer_config
from testing.models import build_gemma3
from tests.faults.helpers import PREFIX_TOKENS, Engine, SinglePool, check_outputs, serve_until_hits

pytestmark = [pytest.mark.faults, pytest.mark.engine, pytest.mark.mooncake, pytest.mark.timeout(300)]


def test_an_engine_started_without_its_master_serves_then_joins_the_pool(
    gemma_dir: Path, references: dict
) -> None:
    pool = SinglePool()  # its ports chosen, nothing started yet
    settings = ConnectorSettings.parse({"master_server_address": pool.address, "cache_prefix": "late"})
    engine: Engine | None = None
    try:
        engine = Engine(gemma_dir, transfer_config(settings), log_stats=True)
        client = scheduler_of(scheduler_connector(engine.llm)).client
        assert not client.attached
        alone = [engine.serve(key) for key in [(0, 0), (0, 1)]]
        assert [s.cached for s in alone] == [0, 0], "no pool: every request computes"
        assert engine.failure_series()["rpc_failed"] >= 2, "each lookup out of the pool is counted"
        assert _in_pool(engine) == 0.0

        pool.start()
        served_at = time.monotonic()
        deadline = served_at + 6 * ATTACH_INTERVAL_S + 60
        while not client.attached:
            assert time.monotonic() < deadline, "the engine never joined the pool"
            time.sleep(0.2)
        joined_at = time.monotonic()
        joined = serve_until_hits(engine, [(0, 2), (0, 3)])
        check_outputs([*alone, *joined], references)
        assert joined[0].cached == 0 and joined[-1].cached >= PREFIX_TOKENS, "hits from the pool"
        assert engine.stored_prefix_keys((0, 0)) > 0
        assert _in_pool(engine) == 1.0
        print(f"joined {joined_at - served_at:.1f} s after the pool served; alone: {len(alone)} requests")
    finally:
        if engine is not None:
            engine.close()
        pool.stop()


def _in_pool(engine: Engine) -> float | None:
    """``vllm:kvpool_in_pool`` as vLLM's metrics registry holds it."""
    values = [metric.value for metric in engine.llm.get_metrics() if metric.name == "vllm:kvpool_in_pool"]
    return float(values[-1]) if values else None


#: The TP=2 engine's process (see the module) and what a TP=2 CPU engine needs here: one
#: OpenMP thread per rank, each on its own core.
TP_ENGINE_MODULE = "tests.faults.late_pool_tp_engine"
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "60"}
TP_PREFIX_TOKENS = 320  # 10 blocks
OUT_OF_POOL = "does not serve; serving without the pool"
JOINED = "joined the pool at"


@pytest.mark.timeout(600)
def test_a_tp2_engine_started_without_its_master_joins_on_every_rank(tmp_path: Path) -> None:
    rng = random.Random(11)
    prefix = [rng.randrange(3, 500) for _ in range(TP_PREFIX_TOKENS)]
    prompt, sharer = ([*prefix, *(rng.randrange(3, 500) for _ in range(20))] for _ in range(2))
    pool = SinglePool()  # its ports chosen, nothing started yet
    settings = ConnectorSettings.parse({"master_server_address": pool.address, "cache_prefix": "late-tp"})
    options = EngineOptions(
        model=str(build_gemma3(tmp_path / "model")),
        kv_transfer_config=transfer_config(settings),
        dtype="float32",
        llm_kwargs={"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
    )
    served_alone, log = tmp_path / "served-alone", tmp_path / "engine.log"
    spec = {
        "opts": asdict(options),
        "prompt": prompt,
        "sharer": sharer,
        "max_tokens": 8,
        "served_alone": str(served_alone),
        "deadline_s": 6 * ATTACH_INTERVAL_S + 60,
    }
    env = engine_env(TP_ENV)
    outcome: dict[str, Any] = {}

    def run_engine() -> None:
        try:
            outcome["result"] = run_module(TP_ENGINE_MODULE, spec, env=env, timeout=480, log_path=log)
        except Exception as error:  # reported below, with the engine's log
            outcome["error"] = error

    engine = threading.Thread(target=run_engine, name="tp-engine")
    engine.start()
    try:
        deadline = time.monotonic() + 300
        while not served_alone.exists() and engine.is_alive():
            assert time.monotonic() < deadline, "the TP=2 engine served nothing without its master"
            time.sleep(0.5)
        pool.start()
    finally:
        engine.join(500)  # its own deadlines end it: serving until deadline_s, then run_module's timeout
        pool.stop()
    assert not engine.is_alive() and "error" not in outcome, outcome.get("error")
    result, text = outcome["result"], log.read_text(errors="replace")
    assert text.count(OUT_OF_POOL) == 3, "the scheduler and both workers started out of the pool"
    assert text.count(JOINED) == 3, "the scheduler and both workers joined the pool"
    assert result["alone"]["cached"] == 0
    assert result["cached"] and result["cached"][-1] == TP_PREFIX_TOKENS, result["cached"]
    assert result["tokens"] == result["alone"]["tokens"], "the pool's KV gives the tokens served without it"
    print(f"TP=2: hit after {len(result['cached'])} tries ({result['cached']})")
