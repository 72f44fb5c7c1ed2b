"""The benchmarks' deferring connector (the floor of asynchronous lookups) defers each request
exactly one step, in a real vLLM scheduler, and keeps nothing of finished requests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from testing.kv_cache import GroupDesc

FULL_SWA = [GroupDesc("full", 32), GroupDesc("sliding_window", 32, window=64)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from testing.models import build_gemma3

    return build_gemma3(tmp_path_factory.mktemp("gemma3-deferring"))


def test_each_request_waits_one_step_then_is_admitted_with_no_hit(model_dir: Path) -> None:
    from vllm.v1.request import RequestStatus

    from testing.deferring_connector import TRANSFER, DeferringConnector
    from testing.scheduler import make_request, make_scheduler

    logging_level = os.environ.get("VLLM_LOGGING_LEVEL")
    scheduler = make_scheduler(model_dir, FULL_SWA, dict(TRANSFER))
    try:
        # Loading it sets nothing that engines started later by other tests would inherit
        # (the benchmarks package, for one, quiets vLLM's logs).
        assert os.environ.get("VLLM_LOGGING_LEVEL") == logging_level
        assert "benchmarks" not in sys.modules
        connector = scheduler.connector
        assert isinstance(connector, DeferringConnector)
        assert len(scheduler.kv_cache_config.kv_cache_groups) == 2, "the hybrid layout is kept (HMA)"
        requests = [make_request(scheduler, list(range(n * 1000, n * 1000 + 3 * 32 + 1))) for n in range(4)]
        for request in requests:
            scheduler.add_request(request)
        assert not scheduler.schedule().num_scheduled_tokens, "every request is deferred in its first step"
        admitted = scheduler.schedule().num_scheduled_tokens
        assert admitted == {r.request_id: 3 * 32 + 1 for r in requests}, "then admitted, computing all"
        scheduler.finish_requests([r.request_id for r in requests], RequestStatus.FINISHED_ABORTED)
        scheduler.schedule()
        assert connector.deferred == set(), "finished requests are forgotten"
    finally:
        scheduler.shutdown()
