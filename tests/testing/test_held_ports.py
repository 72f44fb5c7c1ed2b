"""A server under test gets ports no other test process can take before it binds them.

The operator binds its liveness and metrics ports only once it runs, seconds after its
options are made; Prometheus and etcd a while after theirs are drawn: with ports merely
drawn free, a server another xdist worker started meanwhile could bind one first and the
server died (``EADDRINUSE``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest

from kvpool.connector.local.ports import bindable, listenable
from kvpool.operator.app import OperatorOptions
from testing.kube_api import emulated_cluster, quick_options, running_operator, write_kubeconfig
from testing.services import PrometheusServer
from tests.faults.helpers import Etcd


@pytest.mark.asyncio
async def test_an_operators_ports_are_held_from_its_options_until_it_stops(tmp_path: Path) -> None:
    async with emulated_cluster() as cluster:
        options = OperatorOptions(**quick_options(write_kubeconfig(tmp_path / "kubeconfig", cluster.url)))
        assert options.liveness_endpoint is not None and options.metrics_port is not None
        ports = [urlsplit(options.liveness_endpoint).port, options.metrics_port]
        # Drawn, not yet bound by anyone: no other process can bind them.
        assert [bindable(p) for p in ports if p is not None] == [False, False]
        async with running_operator(cluster, options):
            # The operator itself binds them alongside the hold, and serves.
            for url in (options.liveness_endpoint, f"http://127.0.0.1:{options.metrics_port}/metrics"):
                assert await answers_in_time(url), url
        # Stopped: the ports are free again.
        assert [bindable(p) for p in ports if p is not None] == [True, True]


async def answers_in_time(url: str, timeout_s: float = 60.0) -> bool:
    """Whether ``url`` answers 200 within ``timeout_s`` (a server starting meanwhile)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession() as session:
        while loop.time() < deadline:
            try:
                async with session.get(url) as response:
                    if response.status == 200:
                        return True
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.05)
    return False


def test_prometheus_serves_on_the_port_held_for_it_until_it_stops() -> None:
    prometheus = PrometheusServer({})
    assert not bindable(prometheus.port), "drawn, not yet bound: held"
    with prometheus:
        assert prometheus.api("status/buildinfo")["version"]
    assert listenable(prometheus.port), "stopped: let go"


def test_etcd_serves_on_the_ports_held_for_it_until_it_stops() -> None:
    etcd = Etcd()
    held = [etcd.client_port, etcd.peer_port]
    assert not any(bindable(p) for p in held), "drawn, not yet bound: held"
    try:
        etcd.start()
        etcd.clear()  # answers on its client port
    finally:
        etcd.stop()
    assert all(listenable(p) for p in held), "stopped: let go"
