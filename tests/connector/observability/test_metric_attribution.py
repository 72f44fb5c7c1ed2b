"""Each metric counts what its HELP says, once, where it happened (real Mooncake):

* a save never made (its forward raised) observes no latency and no size.
"""

from __future__ import annotations

import pytest

from kvpool.connector.contract import metric_names as m
from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestSave
from kvpool.connector.observability.vllm_metrics import records_to_data, series_key
from tests.connector.worker.test_worker_transfer import make_caches, two_group_worker

pytestmark = pytest.mark.mooncake


@pytest.fixture
def worker(pool_client, cache_prefix):
    w = two_group_worker(pool_client, cache_prefix)
    w.register_kv_caches(make_caches())
    yield w
    w.shutdown()


def test_a_save_its_forward_dropped_observes_no_latency(worker) -> None:
    """A save not made (the step's forward raised) counts its keys failed and nothing else:
    no 0 s save in the latency histogram, no 0-byte save in the size histogram."""
    save = RequestSave("r", [GroupTransfer(0, ["d0", "d1"], [1, 2]), GroupTransfer(1, ["d2"], [3])])
    worker.drop_saves(PoolConnectorMetadata(saves=[save]))
    data = records_to_data(*worker.stats.drain())
    failed = {"operation": "save", "reason": "forward_failed"}
    assert data["counters"][series_key(m.FAILURES, group=0, group_kind="full", **failed)] == 2
    assert data["counters"][series_key(m.FAILURES, group=1, group_kind="sliding_window", **failed)] == 1
    assert data["histograms"] == {}
