"""Free TCP ports on loopback for the servers a local pool (or a test) starts.

A port the kernel hands out for ``bind(0)`` lies in its ephemeral range, the range it
also takes the local ports of outgoing connections from: between the check and the
server's own bind, any connection on the machine may take it (``EADDRINUSE``). So ports
are drawn at random below that range, where the kernel never picks on its own, and only
a server that binds the same port in that instant can race.

A port a server binds only later, or binds again after a restart, is held meanwhile
(:class:`PortHold`, or :func:`held_port` until :func:`release_port`): no other draw hands it
out, and its own server still binds it (every server here sets ``SO_REUSEADDR``).
"""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

LOOPBACK = "127.0.0.1"
PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Ports drawn from: this many below the ephemeral range (not below 1024).
SPAN = 12000
TRIES = 64


def ephemeral_range(path: Path = PORT_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = (int(part) for part in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def bindable(port: int, host: str = LOOPBACK) -> bool:
    """Whether a TCP socket can bind ``port`` on ``host`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def listenable(port: int, host: str = LOOPBACK) -> bool:
    """Whether a server that sets ``SO_REUSEADDR`` (``mooncake_master``) can listen on ``port`` of
    ``host`` now: not while another socket listens there, but while only closed connections linger
    on it (``TIME_WAIT``: a stopped server's, a while), which a plain bind (:func:`bindable`) refuses."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen()
        except OSError:
            return False
    return True


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on ``host`` now, below the ephemeral range where one is (else one the
    kernel picks). Drawn from the system's randomness: processes forked from one parent
    draw different ports."""
    low, _ = ephemeral_range()
    start = max(1024, low - SPAN)
    if low - start >= 1024:
        for _ in range(TRIES):
            port = start + secrets.randbelow(low - start)
            if bindable(port, host):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class PortHold:
    """Keeps ``port`` from every other draw until :meth:`release`.

    A socket bound to the port (never listening) makes :func:`bindable` false in every
    process and fails every other hold on it, so :func:`free_port` never hands the port
    out, while a server that sets ``SO_REUSEADDR`` (``mooncake_master``, etcd, most
    servers) binds and listens on it alongside the hold, then again after a restart.
    """

    def __init__(self, port: int, host: str = LOOPBACK) -> None:
        self.port = port
        self._socket: socket.socket | None = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            # Bound first without SO_REUSEADDR: a claim no other hold shares, then opened to
            # the server, which binds alongside it with SO_REUSEADDR of its own.
            self._socket.bind((host, port))
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        except OSError:
            self.release()
            raise

    @classmethod
    def drawn(cls, host: str = LOOPBACK) -> PortHold:
        """A hold on a freshly drawn port; drawn again if another process took it in between."""
        for _ in range(TRIES):
            try:
                return cls(free_port(host), host)
            except OSError:
                continue
        raise OSError(f"no port to hold on {host} after {TRIES} draws")

    def release(self) -> None:
        """Let the port go (its server, if any, keeps it while it listens)."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None


#: Ports drawn by :func:`held_port`, held until :func:`release_port`.
_HELD: dict[int, PortHold] = {}


def held_port(host: str = LOOPBACK) -> int:
    """A free port for a server that binds it only later (or again after a restart), held
    (:class:`PortHold`) until :func:`release_port`: a port merely drawn free could be taken
    meanwhile by a server another process starts (``EADDRINUSE``)."""
    hold = PortHold.drawn(host)
    _HELD[hold.port] = hold
    return hold.port


def release_port(*ports: int | None) -> None:
    """Let go of those of ``ports`` that :func:`held_port` drew (others are left as they are:
    a port a user gave was never held)."""
    for port in ports:
        if port is not None and (hold := _HELD.pop(port, None)) is not None:
            hold.release()
