"""The HA view against real HA masters: two ``mooncake_master --enable_ha`` on one etcd.

The Mooncake master exports no leader metric; the dashboards and ``KVPoolNoLeader`` read
leadership from memory: only the leader holds the stores' mounted segments, a standby reports
zero capacity. This checks that reading with real masters elected through a real etcd: with no
store, both masters are up and none serves (the alert's condition holds); once a store mounts,
exactly one master serves and the condition clears.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dashboards import alerts, external, generate, pool_board
from dashboards.conventions import MASTER_JOB
from kvpool.connector.local.pool import (
    LOOPBACK,
    MooncakeMaster,
    MooncakeStore,
    stop_process,
    wait_for_port,
)
from kvpool.connector.local.ports import held_port, release_port
from testing.services import PrometheusServer
from tests.dashboards.queries import panel_queries, substitute

pytestmark = pytest.mark.mooncake


@pytest.fixture
def etcd() -> Iterator[str]:
    """A one-member etcd on loopback; yields its client address."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd not installed: run scripts/setup.sh")
    client, peer = held_port(), held_port()  # held until etcd stops
    data = Path(tempfile.mkdtemp(prefix="kvpool-etcd-"))
    process = subprocess.Popen(
        [
            binary,
            f"--data-dir={data / 'member'}",
            f"--listen-client-urls=http://{LOOPBACK}:{client}",
            f"--advertise-client-urls=http://{LOOPBACK}:{client}",
            f"--listen-peer-urls=http://{LOOPBACK}:{peer}",
            f"--initial-advertise-peer-urls=http://{LOOPBACK}:{peer}",
            f"--initial-cluster=default=http://{LOOPBACK}:{peer}",
            "--log-level=warn",
        ],
        stdout=(data / "etcd.log").open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for_port(client, 30, process)
        yield f"{LOOPBACK}:{client}"
    finally:
        stop_process(process)
        release_port(client, peer)
        shutil.rmtree(data, ignore_errors=True)


def _start_ha_master(etcd: str) -> MooncakeMaster:
    """A master in HA mode (a standby serves its metrics port, not yet its RPC port)."""
    master = MooncakeMaster(
        extra_args=("--enable_ha=true", "--ha_backend_type=etcd", f"--etcd_endpoints={etcd}")
    )
    log = (master.log_dir / "master.log").open("ab")
    master.process = subprocess.Popen(
        master.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    wait_for_port(master.metrics_port, 30, master.process)
    return master


def _role(master: MooncakeMaster) -> str:
    with urllib.request.urlopen(f"http://{LOOPBACK}:{master.metrics_port}/role", timeout=5) as response:
        return response.read().decode()


def _until(check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.5)
    raise AssertionError(f"never: {what}")


def _panel(title: str, ref: str) -> str:
    model = generate.dashboards()[pool_board.UID]
    (query,) = [q for q in panel_queries(pool_board.UID, model) if q.panel == title and q.ref == ref]
    return substitute(query.expr)


def test_only_the_leader_serves_and_no_leader_is_seen(etcd: str) -> None:
    no_leader = next(a for a in alerts.all_alerts() if a.name == "KVPoolNoLeader").expr
    up, serving = _panel("Masters up and serving", "A"), _panel("Masters up and serving", "B")
    masters: list[MooncakeMaster] = []
    store = None
    try:
        masters = [_start_ha_master(etcd) for _ in range(2)]
        targets = {MASTER_JOB: [f"{LOOPBACK}:{m.metrics_port}" for m in masters]}
        with PrometheusServer(targets) as prom:
            prom.wait_for_scrapes(MASTER_JOB)
            _until(lambda: sorted(_role(m) for m in masters) == ["leader", "standby"], "a leader is elected")
            # Both up, no store mounted: nobody serves, and KVPoolNoLeader's condition holds.
            _until(lambda: prom.query(no_leader), "the no-leader condition holds")
            assert float(prom.query(up)[0]["value"][1]) == 2
            assert [float(row["value"][1]) for row in prom.query(serving)] == [0]  # shown, at zero

            store = MooncakeStore(f"etcd://{etcd}", "64MB").start()
            # The leader only; the standby reports zero.
            _until(
                lambda: [float(row["value"][1]) for row in prom.query(serving)] == [1],
                "the leader serves the store's memory",
            )
            leader = next(m for m in masters if _role(m) == "leader")
            holders = prom.query(f"{external.MASTER_CAPACITY} > 0")
            assert [r["metric"]["instance"] for r in holders] == [f"{LOOPBACK}:{leader.metrics_port}"]
            _until(lambda: prom.query(no_leader) == [], "the no-leader condition clears")
    finally:
        for part in masters if store is None else [store, *masters]:
            part.stop()
            shutil.rmtree(part.log_dir, ignore_errors=True)
