"""A store's disk tier, end to end: a working set three times the store's memory keeps its hits.

A pool of one master and one 16 MiB store with a 256 MiB disk tier (``emptyDir``), run on the
test node from what the operator writes (the master's offload flag, the store's offload
variables pointing at the tier's mount, the volume in the pod's own directory). A client on
the host writes 48 MiB through the connector's put path and reads every object back through
its load path: each comes back with its own bytes, and the tier's directory in the store
pod holds at least what memory could not. The pool's status shows the master's own numbers.
Without the tier the same working set loses two thirds
(``tests/connector/local/test_disk_tier.py``, the negative control on the same processes).
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from kvpool.operator import disk_tier, names
from testing.disk_workload import write_and_read
from testing.pool_store import bare_client
from tests.e2e import harness
from tests.e2e.conftest import E2E
from tests.e2e.harness import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

POOL = "tiered"
MASTER = names.master_name(POOL)
STORE = names.store_name(POOL)
SEGMENT = 16 << 20
OBJECT = 512 << 10
WORKING_SET = 3 * SEGMENT // OBJECT


def bytes_under(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def masters_numbers(master_ip: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{master_ip}:9003/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and line[0] != "#"
    }


def test_a_working_set_three_times_memory_keeps_its_hits_through_the_tier(e2e: E2E) -> None:
    spec = harness.pool_spec(
        "nobody",
        {},
        consumers=[],
        store={
            "replicas": 1,
            "segmentSize": f"{SEGMENT >> 20}MB",
            "diskTier": {"capacity": "256MB", "volume": {"type": "emptyDir"}},
        },
    )
    e2e.kube.create(harness.pool_manifest(POOL, spec))
    try:
        wait_for(lambda: e2e.pool_status(POOL).get("phase") == "Ready", 120, "the pool Ready")
        (master,) = [p for p in e2e.pods(MASTER) if p.ready]
        (store,) = [p for p in e2e.pods(STORE) if p.ready]
        tier = store.container().path(disk_tier.MOUNT_PATH)
        assert tier.is_dir() and bytes_under(tier) == 0
        with bare_client(f"{master.ip}:50051") as client:
            result = write_and_read(client, [f"tier-{i}" for i in range(WORKING_SET)], OBJECT)
        assert result.stored == WORKING_SET and result.wrong == 0
        assert result.hits == WORKING_SET, result.misses
        assert bytes_under(tier) >= WORKING_SET * OBJECT - SEGMENT

        # The status's numbers are the master's own (objects, mounted and used memory).
        def matches() -> bool:
            capacity = e2e.pool_status(POOL).get("capacity") or {}
            own = masters_numbers(master.ip)
            return (
                capacity.get("objects") == own["master_key_count"]
                and capacity.get("capacityBytes") == own["master_total_capacity_bytes"] == SEGMENT
                and capacity.get("usedBytes") == own["master_allocated_bytes"]
            )

        wait_for(matches, 60, "the status's capacity equal to the master's own numbers")
    finally:
        e2e.delete_pool(POOL)
