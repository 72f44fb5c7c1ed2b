"""Whether an HA pool's leader serves: asked of the masters' own ``GET /health``.

Every master answers ``/health`` on its metrics port, a standby too:
``{"role": "leader"|"standby", "ha_state": ..., "service_ready": bool,
"leader_address": "host:rpcPort"|null}``. The leader publishes its address in etcd
before it serves (``ha_state`` ``leader_warmup``), so a standby's word that a leader
exists is not enough: the check asks any master (through the master Service), then the
leader it names, and a leader serves only when that leader says ``service_ready``.

A master's answer is not trusted as a URL. Whoever runs a pool can run anything as its
master, and the operator's pod is let into every HA pool's metrics port: a forged
``leader_address`` must never make the operator send a request anywhere else (another
tenant's admin API, a cloud metadata address). So ``leader_address`` is accepted only as an
IP literal and a port (``10.1.2.3:50051``, ``[fd00::3]:50051``), only when that IP is one of
this pool's own master pods (their pod IPs, read from the API), and the operator builds the
URL itself from the IP and the pool's metrics port; redirects are never followed. Of a
refused address the status shows only a short, quoted excerpt.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvpool.operator import names
from kvpool.operator.components import MASTER_HEALTH_PATH

# Where the operator asks a master first: the master Service's metrics port.
SERVICE_HEALTH_URL = "http://{service}.{namespace}.svc:{port}" + MASTER_HEALTH_PATH
# "<IPv4>:<port>" or "[<IPv6>]:<port>", nothing else.
_ADDRESS = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<v4>[0-9.]+)):(?P<port>[0-9]{1,5})")
_EXCERPT = 64

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class LeaderView:
    """Whether a leader serves, and what the masters said."""

    serves: bool
    message: str


class AddressRefused(ValueError):
    """A ``leader_address`` the operator will not ask."""


def health_url(template: str, pool: str, namespace: str, port: int) -> str:
    """The first master to ask: ``template`` filled in for the pool's master Service."""
    return template.format(service=names.master_name(pool), namespace=namespace, port=port)


def master_pods_selector(pool: str) -> str:
    """The label selector of a pool's master pods."""
    return f"{names.LABEL_POOL}={pool},{names.LABEL_COMPONENT}={names.MASTER}"


def unmapped(address: IPAddress) -> IPAddress:
    """``address`` as the host it reaches: an IPv4 one written as IPv6 (``::ffff:a.b.c.d``,
    which a dual-stack socket connects to ``a.b.c.d``) as IPv4."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def pod_ips(pods: Iterable[Mapping[str, Any]]) -> frozenset[IPAddress]:
    """Every IP address of ``pods`` (``status.podIP`` and ``status.podIPs``); others skipped."""
    found: set[IPAddress] = set()
    for pod in pods:
        status = pod.get("status") or {}
        texts = [status.get("podIP"), *((entry or {}).get("ip") for entry in status.get("podIPs") or [])]
        for text in texts:
            try:
                found.add(ipaddress.ip_address(str(text)))
            except ValueError:
                continue
    return frozenset(found)


def excerpt(value: object) -> str:
    """A short, quoted rendering of an untrusted value, for a status message."""
    text = repr(value)
    return text if len(text) <= _EXCERPT else text[: _EXCERPT - 3] + "..."


def parse_leader_address(value: object) -> tuple[IPAddress, int]:
    """``leader_address`` as an IP and a port; ``AddressRefused`` for anything else
    (a hostname, a path, a query, user info, a port out of range)."""
    match = _ADDRESS.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise AddressRefused(f"leader_address {excerpt(value)} is not an IP address and port")
    try:
        address = ipaddress.ip_address(match["v6"] or match["v4"])
    except ValueError:
        raise AddressRefused(f"leader_address {excerpt(value)} is not an IP address and port") from None
    if (match["v6"] is not None) != (address.version == 6):
        raise AddressRefused(f"leader_address {excerpt(value)} is not an IP address and port")
    port = int(match["port"])
    if not 1 <= port <= 65535:
        raise AddressRefused(f"leader_address {excerpt(value)} has no valid port")
    return address, port


def leader_health_url(value: object, master_ips: Collection[IPAddress], metrics_port: int) -> str:
    """The health URL of the leader a master named: built from the IP alone, and only for one
    of the pool's own master pods; ``AddressRefused`` otherwise."""
    address, _ = parse_leader_address(value)
    if address not in master_ips:
        raise AddressRefused(f"leader_address {excerpt(value)} is not one of the pool's master pods")
    host = f"[{address}]" if address.version == 6 else str(address)
    return f"http://{host}:{metrics_port}{MASTER_HEALTH_PATH}"


async def _health(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url, allow_redirects=False) as response:
        if response.status != 200:
            raise aiohttp.ClientResponseError(
                response.request_info, (), status=response.status, message=f"HTTP {response.status}"
            )
        body = await response.json(content_type=None)
    if not isinstance(body, dict):
        raise ValueError(f"{url} answered with {type(body).__name__}, not a JSON object")
    return body


def _shown(leader: object, url: str) -> str:
    """How a serving master is named: its ``leader_address`` when that is an IP and port."""
    try:
        address, port = parse_leader_address(leader)
    except AddressRefused:
        return url
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"


def _serving(health: dict[str, Any]) -> bool:
    return health.get("role") == "leader" and health.get("service_ready") is True


async def check_leader(
    url: str, metrics_port: int, master_ips: Collection[IPAddress], timeout: float = 3.0
) -> LeaderView:
    """Ask the master at ``url``, then the leader it names if that is one of ``master_ips``
    (the pool's master pods); never raises, never follows a redirect."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            first = await _health(session, url)
            leader = first.get("leader_address")
            if _serving(first):
                return LeaderView(True, f"the leader at {_shown(leader, url)} serves")
            if not leader:
                return LeaderView(False, f"no master leads (asked {url}: role {excerpt(first.get('role'))})")
            try:
                leader_url = leader_health_url(leader, master_ips, metrics_port)
            except AddressRefused as exc:
                return LeaderView(False, f"not asked: {exc}")
            answer = await _health(session, leader_url)
            if _serving(answer):
                return LeaderView(True, f"the leader at {leader} serves")
            state = answer.get("ha_state") or answer.get("role")
            return LeaderView(False, f"the leader at {leader} does not serve yet ({excerpt(state)})")
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        return LeaderView(False, f"cannot ask the masters' health ({url}): {exc or type(exc).__name__}")
