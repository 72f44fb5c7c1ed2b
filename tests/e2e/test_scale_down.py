"""Scaling a pool's stores down, end to end: the leaving store is drained first, then removed.

A pool of one master and two stores on the test node; objects written by a client on the
host, most on one store and a few on the other. ``spec.store.replicas`` 2 -> 1: the operator
keeps two replicas while the master drains the emptiest store (its objects move to the
other), that store's own readiness probe (run by the node in its pod) turns it unready, the
operator applies one replica, and the node's Deployment controller removes the pod that is
not ready. Every object still reads back byte for byte; the Events say nothing was lost.
"""

from __future__ import annotations

import re
import urllib.request

import pytest

from kvpool.connector.pool_client import PoolClient
from kvpool.operator import names
from kvpool.operator.names import POOLS
from testing.pool_store import bare_client, put_on, raw_store
from tests.e2e import harness
from tests.e2e.conftest import E2E
from tests.e2e.harness import path, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

POOL = "shrinking"
MASTER = names.master_name(POOL)
STORE = names.store_name(POOL)
POOL_PATH = path(POOLS.api_version, POOLS.kind, POOL)
OBJECT = 1 << 20


def value(i: int) -> bytes:
    return bytes([i % 251]) * (OBJECT - i)


def segments(master_ip: str) -> dict[str, str]:
    """Each mounted segment by its host (a store pod's IP), from the master's own metrics."""
    with urllib.request.urlopen(f"http://{master_ip}:9003/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.findall(r'^segment_total_capacity_bytes\{segment="([^"]+)"\}', text, re.M)
    return {name.rsplit(":", 1)[0]: name for name in found}


def put_keys(client: PoolClient, keys: range, segment: str) -> None:
    for i in keys:
        assert put_on(client, f"drain-{i}", value(i), segment) == 0


def test_scaling_stores_down_drains_the_leaving_store_first(e2e: E2E) -> None:
    spec = harness.pool_spec("nobody", {}, consumers=[])
    e2e.kube.create(harness.pool_manifest(POOL, spec))
    try:
        wait_for(lambda: e2e.pool_status(POOL).get("phase") == "Ready", 120, "the pool Ready")
        (master,) = [p for p in e2e.pods(MASTER) if p.ready]
        stores = wait_for(
            lambda: (pods := [p for p in e2e.pods(STORE) if p.ready]) and len(pods) == 2 and pods,
            60,
            "two ready stores",
        )
        mounted = wait_for(
            lambda: (found := segments(master.ip)) and len(found) == 2 and found, 60, "two segments"
        )
        staying, leaving = stores
        # A new pool's stores wait for their master (``store_wait``) instead of exiting while
        # it starts, as ``mooncake_client`` does after two seconds of reset calls.
        for store in stores:
            (wait,) = store.init_containers
            assert (wait.exit_codes[-1:], store.container().restarts) == ((0,), 0), store.container().log()
        with bare_client(f"{master.ip}:50051") as client:
            put_keys(client, range(6), mounted[staying.ip])
            put_keys(client, range(6, 9), mounted[leaving.ip])  # the emptiest store: it leaves

            e2e.kube.patch(POOL_PATH, {"spec": {"store": {"replicas": 1}}})

            def deployment_replicas() -> int:
                return int(e2e.kube.deployment(STORE)["spec"]["replicas"])

            def drained_then_scaled() -> bool:
                drain = e2e.pool_status(POOL).get("storeDrain")
                if drain is not None and drain["state"] in ("Pending", "Draining"):
                    assert deployment_replicas() == 2, "scaled down before the drain"
                return deployment_replicas() == 1

            wait_for(drained_then_scaled, 180, "one store replica, after the drain")
            wait_for(
                lambda: (
                    [p.name for p in e2e.pods(STORE) if not p.stopped and not p.terminating] == [staying.name]
                ),
                60,
                f"{leaving.name} removed, {staying.name} kept",
            )
            missing = [i for i in range(9) if raw_store(client).get(f"drain-{i}") != value(i)]
            assert missing == []
        events = {e["reason"]: e for e in e2e.kube.events(POOL)}
        assert {"StoreDrainPending", "StoreDraining", "StoreDrained"} <= set(events), sorted(events)
        scale_down = events["StoreScaleDown"]
        assert scale_down["type"] == "Normal"
        assert f"drained {leaving.name} first (3 objects" in scale_down["message"], scale_down
        last = wait_for(lambda: e2e.pool_status(POOL).get("lastScaleDown"), 30, "status.lastScaleDown")
        assert f"drained {leaving.name} first (3 objects" in last["message"], last
        assert "storeDrain" not in e2e.pool_status(POOL)
    finally:
        e2e.delete_pool(POOL)
