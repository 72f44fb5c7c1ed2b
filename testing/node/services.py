"""Services on the test node: cluster DNS as hosts files, and kube-proxy as a TCP relay.

* A ClusterIP Service gets a loopback address of its own (stable while the Service exists;
  the API's ``clusterIP`` is not routable here) and, on each of its ports, a relay to the
  ``targetPort`` of one of its ready pods, taken in turn. With no ready pod, a connection is
  accepted and closed at once.
* A headless Service (``clusterIP: None``) names its ready pods' addresses (all its pods'
  with ``publishNotReadyAddresses``), and each such pod with ``subdomain`` set to the Service
  is named ``<hostname>.<service>``, as for StatefulSets.
* Names are those of cluster DNS: ``<service>.<namespace>.svc.cluster.local``,
  ``<service>.<namespace>.svc`` and ``<service>.<namespace>`` everywhere, ``<service>`` alone
  in the Service's own namespace. Each pod gets a hosts file with them (``sandbox`` mounts
  it over ``/etc/hosts``); :func:`resolving` teaches them to this process too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLUSTER_DOMAIN = "cluster.local"
HOSTS_HEADER = "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n"


@dataclass(frozen=True)
class Endpoint:
    """A pod behind Services: its address, labels, ports by name, readiness, DNS identity."""

    namespace: str
    ip: str
    labels: Mapping[str, str]
    ports: Mapping[str, int]
    ready: bool
    hostname: str = ""
    subdomain: str = ""


def selects(selector: Mapping[str, str] | None, labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in (selector or {}).items())


def target_port(port: Mapping[str, Any], endpoint: Endpoint) -> int | None:
    """The pod port a Service port sends to (a number, or a container port's name)."""
    target = port.get("targetPort", port.get("port"))
    if isinstance(target, int):
        return target
    if isinstance(target, str) and target.isdigit():
        return int(target)
    return endpoint.ports.get(str(target))


def service_names(name: str, namespace: str) -> tuple[str, ...]:
    """Every name of a Service, the fully qualified one first."""
    return (f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}", f"{name}.{namespace}.svc", f"{name}.{namespace}")


@dataclass
class Records:
    """Name -> addresses, each name with the namespace it is known in alone (short names)."""

    names: dict[str, list[str]] = field(default_factory=dict)
    short: dict[tuple[str, str], list[str]] = field(default_factory=dict)

    def add(self, name: str, namespace: str, addresses: Sequence[str]) -> None:
        for fqdn in service_names(name, namespace):
            self.names.setdefault(fqdn, []).extend(addresses)
        self.short.setdefault((namespace, name), []).extend(addresses)

    def hosts(self, namespace: str, own: str = "") -> str:
        """A hosts file for a pod in ``namespace`` (``own``: its own line, first)."""
        lines = [HOSTS_HEADER.rstrip("\n")]
        if own:
            lines.append(own)
        for name, addresses in sorted(self.names.items()):
            lines += [f"{address} {name}" for address in addresses]
        for (where, name), addresses in sorted(self.short.items()):
            if where == namespace:
                lines += [f"{address} {name}" for address in addresses]
        return "\n".join(lines) + "\n"

    def lookup(self, name: str) -> list[str]:
        return list(self.names.get(name.rstrip(".").lower(), []))


def records(
    services: Sequence[Mapping[str, Any]], endpoints: Sequence[Endpoint], addresses: Mapping[str, str]
) -> Records:
    """DNS for ``services`` (``addresses``: uid -> the node's address of a ClusterIP Service)."""
    out = Records()
    for service in services:
        meta, spec = service["metadata"], service.get("spec") or {}
        name, namespace = meta["name"], meta["namespace"]
        if spec.get("clusterIP") != "None":
            if meta["uid"] in addresses:
                out.add(name, namespace, [addresses[meta["uid"]]])
            continue
        published = spec.get("publishNotReadyAddresses", False)
        members = [
            e
            for e in endpoints
            if e.namespace == namespace and selects(spec.get("selector"), e.labels) and (e.ready or published)
        ]
        out.add(name, namespace, [e.ip for e in members])
        for member in members:
            if member.hostname and member.subdomain == name:
                out.add(f"{member.hostname}.{name}", namespace, [member.ip])
    return out


class Relay:
    """One ClusterIP Service's ports on its own loopback address, each relayed to a ready pod."""

    def __init__(self, address: str, backends: Callable[[Mapping[str, Any]], list[tuple[str, int]]]):
        self.address = address
        self._backends = backends
        self._servers: dict[int, asyncio.Server] = {}
        self._turn = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()

    async def serve(self, ports: Sequence[Mapping[str, Any]]) -> None:
        """Listen on exactly ``ports`` (``Service.spec.ports``)."""
        wanted = {int(p["port"]): p for p in ports if p.get("protocol", "TCP") == "TCP"}
        for number in set(self._servers) - set(wanted):
            self._servers.pop(number).close()
        for number, port in wanted.items():
            if number not in self._servers:
                self._servers[number] = await asyncio.start_server(
                    lambda r, w, p=port: self._relay(r, w, p), self.address, number, reuse_address=True
                )

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: Any) -> None:
        backends = self._backends(port)
        if not backends:
            writer.close()
            return
        host, number = backends[next(self._turn) % len(backends)]
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(host, number)
        except OSError:
            writer.close()
            return
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
        finally:
            if task is not None:
                self._tasks.discard(task)

    async def close(self) -> None:
        for server in self._servers.values():
            server.close()
        for server in self._servers.values():
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self._servers.clear()
        for task in list(self._tasks):
            task.cancel()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.close()


def write_if_changed(path: Path, content: str) -> None:
    """Rewrite ``path`` in place (a bind mount follows the inode, not the name)."""
    try:
        if path.read_text() == content:
            return
    except FileNotFoundError:
        path.write_text(content)
        return
    with path.open("r+") as handle:
        handle.write(content)
        handle.truncate()


@contextlib.contextmanager
def resolving(lookup: Callable[[str], list[str]]) -> Iterator[None]:
    """This process resolves cluster names through ``lookup`` (others as before) until the block ends."""
    original = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, bytes):
            host = host.decode()
        if isinstance(host, str):
            found = lookup(host)
            if found:
                return original(found[0], *args, **kwargs)
        return original(host, *args, **kwargs)

    socket.getaddrinfo = getaddrinfo
    try:
        yield
    finally:
        socket.getaddrinfo = original
