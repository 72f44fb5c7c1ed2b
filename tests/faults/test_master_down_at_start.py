"""A real engine started while its master is down: it starts at once and serves without the
pool (each lookup a counted ``rpc_failed``, ``vllm:kvpool_in_pool`` 0), then joins the pool
once the master serves, with the KV memory it registered before, and its hits load KV equal to
a run without the pool.

Before, the connector's setup failed after its RPC retries and the engine did not start:
every replica created during an outage of the pool crash-looped instead of serving.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.pool_attach import ATTACH_INTERVAL_S
from testing.engine import scheduler_connector, scheduler_of, transfer_config
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
