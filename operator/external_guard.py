"""What an external pool's ``metricsEndpoints`` may reach: never a pool this operator runs in
another namespace.

The operator's pods are let into the HTTP port of every pool it runs (health, capacity, drain
jobs). An external pool naming another namespace's master, by its Service's name, an
ExternalName of its own or an IP literal, would have the operator read that pool's numbers
into a status the external pool's author reads. So each endpoint's host is resolved once,
every address is checked against the masters and stores this operator runs in other
namespaces, and the request goes to exactly the addresses checked (:class:`PinnedResolver`:
a DNS answer that changes in between is never asked).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from aiohttp.abc import AbstractResolver, ResolveResult

from kvpool.operator import names
from kvpool.operator.kube import KubeClient
from kvpool.operator.leader import IPAddress, pod_ips, unmapped
from kvpool.operator.names import PODS, POOLS, SERVICES

# Where each address of a pool this operator runs leads: (namespace, pool).
PoolAddresses = Mapping[IPAddress, tuple[str, str]]
# The addresses of the pools in other namespaces than an external pool's.
Elsewhere = Collection[IPAddress]


async def pool_addresses(kube: KubeClient, watched: Sequence[str]) -> dict[IPAddress, tuple[str, str]]:
    """The addresses of the masters and stores this operator runs (their master Service's
    cluster IPs and their pods' IPs), within what it watches (``watched`` empty: every
    namespace): per namespace one list of pools and one of each component's pods, and one
    read of each master Service. Raises :class:`ApiError` when one cannot be read."""
    scopes: list[str | None] = list(watched) if watched else [None]
    found: dict[IPAddress, tuple[str, str]] = {}
    for scope in scopes:
        pools = set()
        for pool in await kube.list(POOLS, scope):
            meta = pool.get("metadata") or {}
            where, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
            if name:
                pools.add((where, name))
        for where, name in sorted(pools):
            service = await kube.get(SERVICES, where, names.master_name(name))
            found.update(dict.fromkeys(_cluster_ips(service), (where, name)))
        for component in (names.MASTER, names.STORE):
            selector = f"{names.LABEL_POOL},{names.LABEL_COMPONENT}={component}"
            for pod in await kube.list(PODS, scope, label_selector=selector):
                meta = pod.get("metadata") or {}
                owner = (
                    str(meta.get("namespace") or ""),
                    str((meta.get("labels") or {}).get(names.LABEL_POOL)),
                )
                if owner in pools:
                    found.update(dict.fromkeys(pod_ips([pod]), owner))
    return found


def elsewhere_of(addresses: PoolAddresses, namespace: str) -> frozenset[IPAddress]:
    """Of ``addresses``, those of pools in other namespaces than ``namespace``."""
    return frozenset(ip for ip, (ns, _) in addresses.items() if ns != namespace)


def _cluster_ips(service: Mapping[str, object] | None) -> set[IPAddress]:
    spec = (service or {}).get("spec")
    if not isinstance(spec, Mapping):
        return set()
    texts = [spec.get("clusterIP"), *(spec.get("clusterIPs") or [])]
    out: set[IPAddress] = set()
    for text in texts:
        try:
            out.add(ipaddress.ip_address(str(text)))
        except ValueError:  # "None" (headless) or absent
            continue
    return out


@dataclass(frozen=True)
class Vetted:
    """Endpoints checked: the addresses each host may be asked at, or why none is asked."""

    addresses: Mapping[tuple[str, int], tuple[ResolveResult, ...]] = field(default_factory=dict)
    problem: str | None = None
    reason: str = "Unreachable"  # or EndpointRefused: it leads to another namespace's pool


def _host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def host_key(host: str) -> str:
    """A host as the HTTP client asks its resolver for it (case and a final dot aside)."""
    return host.strip("[]").rstrip(".").lower()


async def vet_endpoints(
    endpoints: Sequence[str], elsewhere: Elsewhere, timeout: float, *, field_name: str
) -> Vetted:
    """Resolve each ``host:port`` once (all within ``timeout``) and refuse all of them when any
    address leads to another namespace's pool: the message names the field, never that pool."""
    loop = asyncio.get_running_loop()
    addresses: dict[tuple[str, int], tuple[ResolveResult, ...]] = {}
    try:
        async with asyncio.timeout(timeout):
            for index, endpoint in enumerate(endpoints):
                where = f"{field_name}[{index}] {endpoint!r}"
                host, port = _host_port(endpoint)
                try:
                    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                except (OSError, ValueError) as exc:  # ValueError: a name IDNA refuses
                    return Vetted(problem=f"{where} does not resolve: {exc}")
                results = []
                for family, _, proto, _, sockaddr in infos:
                    address = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
                    if address in elsewhere or unmapped(address) in elsewhere:
                        return Vetted(
                            problem=f"{where} reaches a pool this operator runs in another namespace: "
                            "not asked (name the external master's own address)",
                            reason="EndpointRefused",
                        )
                    results.append(
                        ResolveResult(
                            hostname=host,
                            host=str(address),
                            port=port,
                            family=family,
                            proto=proto,
                            flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV,
                        )
                    )
                addresses[(host_key(host), port)] = tuple(results)
    except TimeoutError:
        return Vetted(problem=f"{field_name}: not resolved within {timeout:g} s: not asked")
    return Vetted(addresses=addresses)


class PinnedResolver(AbstractResolver):
    """Answers only the hosts :func:`vet_endpoints` checked, with the addresses it checked."""

    def __init__(self, addresses: Mapping[tuple[str, int], Sequence[ResolveResult]]):
        self._addresses = addresses

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = list(self._addresses.get((host_key(host), port), ()))
        if not found:
            raise OSError(f"{host}:{port} was not checked: not asked")
        return found

    async def close(self) -> None:
        return None
