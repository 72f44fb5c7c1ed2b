"""One poll of a master: a deadline, GET only, no redirects, capped bodies, numbers kept.

The servers here are plain loopback HTTP servers standing in for what is not a Mooncake
master (one that never answers, one that redirects, one that sends too much); a real
master's answers are polled in ``test_real_mooncake.py``."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import pytest_asyncio
from aiohttp import web

from kvpool.operator.observation import MAX_BODY, poll_master

pytestmark = pytest.mark.asyncio

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest_asyncio.fixture
async def serve() -> AsyncIterator[Callable[[dict[str, Handler]], Awaitable[str]]]:
    runners: list[web.AppRunner] = []

    async def start(routes: dict[str, Handler]) -> str:
        app = web.Application()
        for path, handler in routes.items():
            app.router.add_get(path, handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_a_master_that_never_answers_costs_one_deadline() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()  # accepts connections, never answers
    try:
        base = f"http://127.0.0.1:{listener.getsockname()[1]}"
        observation = await poll_master([base], now="t", timeout=0.3)
    finally:
        listener.close()
    assert observation.numbers is None and observation.reason == "Unreachable"
    assert "within 0.3 s" in (observation.problem or "")


async def test_a_redirect_is_not_followed(serve: Callable[[dict[str, Handler]], Awaitable[str]]) -> None:
    asked: list[str] = []

    async def elsewhere(request: web.Request) -> web.StreamResponse:
        asked.append(request.path)
        raise web.HTTPFound("http://169.254.169.254/latest/meta-data")

    base = await serve({"/health": elsewhere})
    observation = await poll_master([base], now="t", timeout=5)
    assert observation.reason == "Unreachable" and "HTTP 302" in (observation.problem or "")
    assert asked == ["/health"]


async def test_what_is_not_a_master_is_said_and_not_kept(
    serve: Callable[[dict[str, Handler]], Awaitable[str]],
) -> None:
    async def health(_: web.Request) -> web.StreamResponse:
        return web.json_response({"role": "leader", "service_ready": True})

    async def huge(_: web.Request) -> web.StreamResponse:
        return web.Response(text="x" * (MAX_BODY + 1))

    async def secret(_: web.Request) -> web.StreamResponse:
        return web.Response(text="token=hunter2\n")

    big = await poll_master([await serve({"/health": health, "/metrics": huge})], now="t", timeout=5)
    assert big.reason == "NotAMaster" and "more than" in (big.problem or "")
    other = await poll_master([await serve({"/health": health, "/metrics": secret})], now="t", timeout=5)
    assert other.reason == "NotAMaster" and "hunter2" not in (other.problem or "")


async def test_a_standby_names_a_leader_that_is_asked_only_among_the_pools_masters(
    serve: Callable[[dict[str, Handler]], Awaitable[str]],
) -> None:
    async def standby(_: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"role": "standby", "service_ready": False, "leader_address": "10.9.9.9:50051"}
        )

    observation = await poll_master(
        [await serve({"/health": standby})], now="t", timeout=5, master_ips=frozenset(), metrics_port=9003
    )
    assert observation.reason == "NoLeader"
    assert "not one of the pool's master pods" in (observation.problem or "")
    await asyncio.sleep(0)
