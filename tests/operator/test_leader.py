"""The HA leader check never becomes a request forgery: a master's ``leader_address`` is
asked only when it is an IP and port of one of the pool's own master pods, the URL is the
operator's own, and no redirect is followed.

Real HTTP servers on loopback addresses play the masters and a "victim" (another tenant's
admin API, a metadata service); each records every request it gets.
"""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from kvpool.connector.local.ports import free_port
from kvpool.operator import names
from kvpool.operator.leader import (
    AddressRefused,
    check_leader,
    leader_health_url,
    parse_leader_address,
    pod_ips,
)
from testing.kube_api import Cluster, eventually
from testing.operator_objects import Operator, pool_manifest, pool_pod, pool_spec

STANDBY = "127.0.0.2"  # a master pod of the pool, asked first (the master Service)
LEADER = "127.0.0.4"  # the other master pod of the pool
VICTIM = "127.0.0.3"  # not the pool's: nothing may ever reach it
HOSTNAME_VICTIM = "127.0.0.1"  # where "localhost" resolves


@dataclass
class Recorder:
    """An HTTP server on ``host:port`` answering every request with ``answer``; it keeps
    each path (and query) it was asked."""

    host: str
    port: int
    answer: Callable[[web.Request], web.StreamResponse]
    seen: list[str] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(request.path_qs)
        return self.answer(request)


@pytest_asyncio.fixture
async def servers() -> AsyncIterator[Callable[..., Any]]:
    """Start recorders on loopback; all are stopped at the end."""
    runners: list[web.AppRunner] = []

    async def start(host: str, port: int, answer: Callable[[web.Request], web.StreamResponse]) -> Recorder:
        recorder = Recorder(host, port, answer)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", recorder.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, host, port).start()
        return recorder

    try:
        yield start
    finally:
        for runner in runners:
            await runner.cleanup()


def health(role: str, leader: object = None, ready: bool = False) -> Callable[[web.Request], web.Response]:
    body = {"role": role, "ha_state": role, "service_ready": ready, "leader_address": leader}
    return lambda _: web.json_response(body)


def redirect(to: str) -> Callable[[web.Request], web.Response]:
    return lambda _: web.Response(status=302, headers={"Location": to})


def ips(*hosts: str) -> frozenset[Any]:
    return frozenset(ipaddress.ip_address(h) for h in hosts)


MASTERS = ips(STANDBY, LEADER)


@pytest.mark.asyncio
async def test_a_standby_names_a_leader_among_the_pools_masters(servers: Callable[..., Any]) -> None:
    port = free_port()
    await servers(STANDBY, port, health("standby", f"{LEADER}:50051"))
    leader = await servers(LEADER, port, health("leader", f"{LEADER}:50051", ready=True))
    view = await check_leader(f"http://{STANDBY}:{port}/health", port, MASTERS)
    assert view.serves and view.message == f"the leader at {LEADER}:50051 serves"
    assert leader.seen == ["/health"]


@pytest.mark.parametrize(
    ("forged", "why"),
    [
        ("{victim}:{port}/get_all_keys?x=:1", "is not an IP address and port"),
        ("{victim}:{port}/api/v1/remove_all#", "is not an IP address and port"),
        ("localhost:50051", "is not an IP address and port"),
        ("user@{victim}:50051", "is not an IP address and port"),
        ("{victim}:50051", "is not one of the pool's master pods"),
        ("[::ffff:{victim}]:50051", "is not one of the pool's master pods"),
        ("{victim}:99999", "has no valid port"),
        (["{victim}:50051"], "is not an IP address and port"),
    ],
)
@pytest.mark.asyncio
async def test_a_forged_leader_address_reaches_no_other_address(
    servers: Callable[..., Any], forged: Any, why: str
) -> None:
    port = free_port()
    fill = (lambda s: s.format(victim=VICTIM, port=port)) if isinstance(forged, str) else None
    value = fill(forged) if fill else [item.format(victim=VICTIM) for item in forged]
    standby = await servers(STANDBY, port, health("standby", value))
    victim = await servers(VICTIM, port, health("leader", f"{VICTIM}:50051", ready=True))
    localhost = await servers(HOSTNAME_VICTIM, port, health("leader", "127.0.0.1:50051", ready=True))
    view = await check_leader(f"http://{STANDBY}:{port}/health", port, MASTERS)
    assert not view.serves
    assert view.message.startswith("not asked: leader_address") and why in view.message
    assert len(view.message) < 200
    assert standby.seen == ["/health"]
    assert victim.seen == [] and localhost.seen == []


@pytest.mark.asyncio
async def test_redirects_are_never_followed(servers: Callable[..., Any]) -> None:
    port = free_port()
    victim = await servers(VICTIM, port, health("leader", f"{VICTIM}:50051", ready=True))
    await servers(STANDBY, port, redirect(f"http://{VICTIM}:{port}/get_all_keys"))
    view = await check_leader(f"http://{STANDBY}:{port}/health", port, MASTERS)
    assert not view.serves and "HTTP 302" in view.message
    # The leader, one of the pool's masters, redirects too.
    other = free_port()
    await servers(STANDBY, other, health("standby", f"{LEADER}:50051"))
    leader = await servers(LEADER, other, redirect(f"http://{VICTIM}:{port}/get_all_keys"))
    view = await check_leader(f"http://{STANDBY}:{other}/health", other, MASTERS)
    assert not view.serves and "HTTP 302" in view.message
    assert leader.seen == ["/health"] and victim.seen == []


def test_leader_addresses_parse_strictly() -> None:
    assert parse_leader_address("10.1.2.3:50051") == (ipaddress.ip_address("10.1.2.3"), 50051)
    assert parse_leader_address("[fd00::3]:50051") == (ipaddress.ip_address("fd00::3"), 50051)
    for bad in (
        "10.0.0.5:9003/get_all_keys?x=:1",  # another tenant's admin API, as the issue found it
        "metadata.google.internal:80",
        "10.1.2.3",
        "10.1.2.3:",
        "10.1.2:80",
        "fd00::3:50051",
        "[10.1.2.3]:80",
        "10.1.2.3:80 ",
        "10.1.2.3:80\n",  # re.match with "$" took a trailing newline
        "[fd00::3]:80\n",
        None,
        5,
    ):
        with pytest.raises(AddressRefused):
            parse_leader_address(bad)
    url = leader_health_url("[fd00::3]:50051", ips("fd00::3"), 9003)
    assert url == "http://[fd00::3]:9003/health"


def test_pod_ips_come_from_the_pods_status() -> None:
    pods = [
        {"status": {"podIP": "10.0.0.7", "podIPs": [{"ip": "10.0.0.7"}, {"ip": "fd00::7"}]}},
        {"status": {}},
        {"status": {"podIP": "not-an-ip"}},
    ]
    assert pod_ips(pods) == ips("10.0.0.7", "fd00::7")


def master_pod(name: str, ip: str, pool: str = "pool") -> dict[str, Any]:
    return pool_pod(name, ip, names.MASTER, pool=pool, all_ips=True)


HA_PORT = free_port()


@pytest.mark.parametrize("operator_config", [{"master_health_url": f"http://{STANDBY}:{{port}}/health"}])
@pytest.mark.asyncio
async def test_the_operator_asks_only_the_pools_own_master_pods(
    cluster: Cluster, operator: Operator, servers: Callable[..., Any]
) -> None:
    """The operator reads the pool's master pods from the API: a leader_address at another
    pool's master pod is refused; at one of its own, asked."""
    spec = pool_spec(
        consumers=[],
        master={
            "replicas": 2,
            "metricsPort": HA_PORT,
            "ha": {"enabled": True, "etcdEndpoints": ["etcd:2379"]},
        },
    )
    standby = await servers(STANDBY, HA_PORT, health("standby", f"{VICTIM}:50051"))
    victim = await servers(VICTIM, HA_PORT, health("leader", f"{VICTIM}:50051", ready=True))
    await cluster.create(master_pod("pool-master-a", STANDBY))
    await cluster.create(master_pod("other-master-a", VICTIM, pool="other"))
    await cluster.create(pool_manifest(spec=spec))

    def master_ready() -> dict[str, Any]:
        cluster.settle()
        return cluster.condition("pool", "MasterReady")

    refused = await eventually(
        lambda: "not one of the pool's master pods" in master_ready().get("message", "")
    )
    assert refused and master_ready()["status"] == "False" and standby.seen and victim.seen == []

    # The named leader is now one of the pool's own master pods: asked, and it serves.
    await cluster.create(master_pod("pool-master-b", VICTIM))
    await eventually(lambda: master_ready().get("status") == "True", what="MasterReady")
    assert set(victim.seen) == {"/health"}
