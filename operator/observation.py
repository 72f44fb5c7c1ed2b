"""Asking a pool's master for its health and numbers: one poll, with a deadline.

The poll runs in the operator's observation timer, never inside a reconcile pass: a
master that does not answer costs at most ``timeout`` seconds of that timer and blocks no
pass. It reads only ``GET /health`` and ``GET /metrics`` (never the admin API), follows no
redirect, reads at most ``MAX_BODY`` bytes, and keeps only parsed numbers (``master_view``).

Whom it asks:

* a pool's own master: its Service's HTTP port. With HA the Service may answer from a
  standby, which names the leader; the leader is asked only at one of the pool's own master
  pods' IPs (``leader.leader_health_url``: a forged ``leader_address`` never sends the
  operator anywhere else);
* an external pool: each of ``spec.external.metricsEndpoints`` in turn, until one serves
  (the author's addresses, asked only for ``/health`` and ``/metrics``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver

from kvpool.operator.components import MASTER_HEALTH_PATH
from kvpool.operator.leader import AddressRefused, IPAddress, excerpt, leader_health_url
from kvpool.operator.master_view import (
    MasterHealth,
    MasterNumbers,
    MasterTextError,
    parse_health,
    parse_metrics,
)

METRICS_PATH = "/metrics"
# A master's /metrics is a few hundred lines; a body this large is not a master's.
MAX_BODY = 4 << 20


@dataclass(frozen=True)
class Observation:
    """One poll of a pool's master: who answered and its numbers, or why there are none."""

    at: str
    master: str = ""
    numbers: MasterNumbers | None = None
    problem: str | None = None
    reason: str = "Answered"  # or Unreachable, NoLeader, NotAMaster
    # Store pods by IP, to name the pod of each segment.
    store_pods: Mapping[str, str] = field(default_factory=dict)
    # What the poll asked (the operator's key of the pool's master and ports): an answer
    # vouches for that only.
    asked: tuple[Any, ...] = ()

    @property
    def answered(self) -> bool:
        return self.numbers is not None


class _Refused(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


async def _get(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url, allow_redirects=False) as response:
        if response.status != 200:
            raise _Refused("Unreachable", f"{url} answered HTTP {response.status}")
        body = bytearray()
        async for chunk in response.content.iter_chunked(1 << 16):
            body += chunk
            if len(body) > MAX_BODY:
                raise _Refused("NotAMaster", f"{url} answered more than {MAX_BODY} bytes")
    return body.decode("utf-8", errors="replace")


def base_of(health_url: str) -> str:
    """``http://host:port`` of a master's health URL."""
    return health_url.removesuffix(MASTER_HEALTH_PATH)


async def _health(session: aiohttp.ClientSession, base: str) -> MasterHealth:
    try:
        return parse_health(await _get(session, base + MASTER_HEALTH_PATH))
    except MasterTextError as exc:
        raise _Refused("NotAMaster", f"{base}: {exc}") from None


async def _numbers(session: aiohttp.ClientSession, base: str) -> MasterNumbers:
    try:
        return parse_metrics(await _get(session, base + METRICS_PATH))
    except MasterTextError as exc:
        raise _Refused("NotAMaster", f"{base}: {exc}") from None


async def _serving_base(
    session: aiohttp.ClientSession,
    bases: list[str],
    master_ips: Collection[IPAddress] | None,
    metrics_port: int,
) -> str:
    """The first of ``bases`` that serves, or the leader one names (only among ``master_ips``,
    the pool's own master pods; None: follow no leader address)."""
    said = []
    for base in bases:
        try:
            health = await _health(session, base)
        except (aiohttp.ClientError, _Refused) as exc:
            said.append(f"{base}: {exc or type(exc).__name__}")
            continue
        if health.serves:
            return base
        said.append(f"{base}: role {excerpt(health.role)}, not serving")
        if master_ips is not None and health.leader_address:
            try:
                leader = base_of(leader_health_url(health.leader_address, master_ips, metrics_port))
            except AddressRefused as exc:
                said.append(f"not asked: {exc}")
                continue
            if (await _health(session, leader)).serves:
                return leader
            said.append(f"the leader at {excerpt(health.leader_address)} does not serve yet")
    reason = "NoLeader" if any("not serving" in s for s in said) else "Unreachable"
    raise _Refused(reason, "; ".join(said) or "no master to ask")


async def poll_master(
    bases: list[str],
    *,
    now: str,
    timeout: float,
    master_ips: Collection[IPAddress] | None = None,
    metrics_port: int = 0,
    store_pods: Mapping[str, str] | None = None,
    resolver: AbstractResolver | None = None,
) -> Observation:
    """Ask the masters at ``bases`` (``http://host:port``) for the serving one's numbers, all
    within ``timeout`` seconds; never raises for what a master does or does not answer.
    ``resolver``: the only way their names resolve (None: the system's)."""
    pods = dict(store_pods or {})
    try:
        async with asyncio.timeout(timeout):
            client_timeout = aiohttp.ClientTimeout(total=timeout)
            connector = aiohttp.TCPConnector(resolver=resolver) if resolver is not None else None
            async with aiohttp.ClientSession(timeout=client_timeout, connector=connector) as session:
                base = await _serving_base(session, bases, master_ips, metrics_port)
                numbers = await _numbers(session, base)
    except _Refused as exc:
        return Observation(now, problem=str(exc), reason=exc.reason, store_pods=pods)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        return Observation(
            now,
            problem=f"no answer from {', '.join(bases)} within {timeout:g} s: {exc or type(exc).__name__}",
            reason="Unreachable",
            store_pods=pods,
        )
    return Observation(now, master=base.removeprefix("http://"), numbers=numbers, store_pods=pods)
