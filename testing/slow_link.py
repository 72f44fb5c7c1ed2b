"""A slow link between an engine and its pool: a real one where the machine allows, else emulated.

* :class:`NamespaceLink`: a network namespace joined to this one by a veth pair with
  loopback-range addresses (``127.77.<n>.1`` here, ``.2`` there), each side's egress
  rate-limited by a token-bucket qdisc (``tc ... tbf rate``). A pool started inside the
  namespace (``ip netns exec``) is reached only through the limited pair. Needs root, network
  namespaces and the tbf qdisc (this machine's kernel has no netem: ``tc ... netem rate``
  answers "Specified qdisc kind is unknown"; tbf limits the rate alike). Created and removed
  by its ``with`` block; nothing else on the host changes (a route for its /30 in the local
  table, ``route_localnet`` on its own interface, both gone with the interface).
* :class:`RateCap`: reads of Mooncake's client take at least their bytes over a rate, queued as
  on one shared link: the same effect emulated in process, where no namespace can be made.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import pytest

#: The store method that reads objects into the connector's buffers.
READ_METHOD = "batch_get_into_multi_buffers"


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise OSError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")


def namespace_link_problem() -> str | None:
    """Why no :class:`NamespaceLink` can be made here; None when one can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no {tool} command"
    try:
        with NamespaceLink(rate_mbit=1000, index=254):
            pass
    except OSError as exc:
        return str(exc)
    return None


@dataclass
class NamespaceLink:
    """Namespace ``kvpool-slow<index>`` behind a veth pair limited to ``rate_mbit`` each way."""

    rate_mbit: float
    index: int = 1
    burst_kib: int = 64
    _made: list[str] = field(default_factory=list)

    @property
    def namespace(self) -> str:
        return f"kvpool-slow{self.index}"

    @property
    def host_address(self) -> str:
        return f"127.77.{self.index}.1"

    @property
    def inside_address(self) -> str:
        return f"127.77.{self.index}.2"

    def prefix(self) -> list[str]:
        """The argv prefix that runs a command inside the namespace."""
        return ["ip", "netns", "exec", self.namespace]

    def __enter__(self) -> Self:
        ns, host_if, inside_if = self.namespace, f"kvs{self.index}h", f"kvs{self.index}n"
        inside = self.prefix()
        subnet = f"127.77.{self.index}.0/30"
        try:
            _run("ip", "netns", "add", ns)
            self._made.append("ns")
            _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", inside_if)
            self._made.append("link")
            _run("ip", "link", "set", inside_if, "netns", ns)
            sides: tuple[tuple[list[str], str, str], ...] = (
                ([], host_if, self.host_address),
                (inside, inside_if, self.inside_address),
            )
            for run_in, iface, address in sides:
                _run(*run_in, "sysctl", "-qw", f"net.ipv4.conf.{iface}.route_localnet=1")
                _run(*run_in, "ip", "addr", "add", f"{address}/30", "dev", iface)
                _run(*run_in, "ip", "link", "set", iface, "up")
                # 127/8 is local on both sides: this /30 goes over the pair instead.
                route = ("route", "add", subnet, "dev", iface, "table", "local", "scope", "link")
                _run(*run_in, "ip", *route, "src", address)
                _run(*run_in, "tc", "qdisc", "add", "dev", iface, "root", *self._tbf(self.rate_mbit))
            _run(*inside, "ip", "link", "set", "lo", "up")
        except OSError:
            self.__exit__(None, None, None)
            raise
        return self

    def _tbf(self, rate_mbit: float) -> tuple[str, ...]:
        # The bucket holds at least 10 ms of the rate (a smaller one cannot reach it).
        burst_kib = max(self.burst_kib, int(rate_mbit * 1e6 / 8 / 100 / 1024))
        return ("tbf", "rate", f"{rate_mbit}mbit", "burst", f"{burst_kib}kb", "latency", "100ms")

    def set_rate(self, rate_mbit: float) -> None:
        """Limit both directions to ``rate_mbit`` from now on."""
        inside = self.prefix()
        for run_in, iface in (([], f"kvs{self.index}h"), (inside, f"kvs{self.index}n")):
            _run(*run_in, "tc", "qdisc", "change", "dev", iface, "root", *self._tbf(rate_mbit))
        self.rate_mbit = rate_mbit

    def __exit__(self, *exc: object) -> None:
        if "link" in self._made:
            # Deleting one end removes the pair, its addresses and its routes.
            subprocess.run(["ip", "link", "del", f"kvs{self.index}h"], capture_output=True, check=False)
        if "ns" in self._made:
            subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True, check=False)
        self._made.clear()


@dataclass
class NamespacePool:
    """A Mooncake master and store inside ``link``'s namespace, reached over the limited pair.

    The same processes :class:`kvpool.connector.local.pool.LocalPool` starts, bound to the
    namespace's address; clients in this namespace use ``address`` and set their own
    ``local_hostname`` to ``link.host_address``.
    """

    link: NamespaceLink
    segment_size: str = "512MB"
    rpc_port: int = 50151
    metrics_port: int = 50152
    store_port: int = 50153
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvpool-slow-pool-")))
    _processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.link.inside_address}:{self.rpc_port}"

    def __enter__(self) -> Self:
        from kvpool.connector.contract.mooncake_env import client_env
        from kvpool.connector.local.pool import find_binary, start_logged

        host = self.link.inside_address
        master = [
            find_binary("mooncake_master"),
            f"--rpc_address={host}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={host}",
            f"--metrics_port={self.metrics_port}",
            f"--http_metadata_server_host={host}",
            "--rpc_thread_num=4",
        ]
        store = [
            find_binary("mooncake_client"),
            f"--host={host}",
            f"--port={self.store_port}",
            f"--master_server_address={self.address}",
            "--metadata_server=P2PHANDSHAKE",
            "--protocol=tcp",
            f"--global_segment_size={self.segment_size}",
        ]
        try:
            self._processes.append(start_logged([*self.link.prefix(), *master], self.log_dir / "master.log"))
            _wait_for(host, self.rpc_port, self._processes[-1])
            env = {**os.environ, **client_env(host)}
            self._processes.append(
                start_logged([*self.link.prefix(), *store], self.log_dir / "store.log", env)
            )
            _wait_for(host, self.store_port, self._processes[-1])
            time.sleep(1.0)  # the store mounts its segment on the master
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        from kvpool.connector.local.pool import stop_process

        for process in reversed(self._processes):
            stop_process(process)
        self._processes.clear()
        shutil.rmtree(self.log_dir, ignore_errors=True)


def _wait_for(host: str, port: int, process: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exited with {process.returncode} before listening on {host}:{port}")
        with socket.socket() as sock:
            sock.settimeout(0.2)
            if sock.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout} s")


def _store_class() -> Any:
    from mooncake.store import MooncakeDistributedStore

    return MooncakeDistributedStore


@dataclass
class RateCap:
    """Reads return no sooner than their bytes take at ``bytes_per_s`` over one shared link.

    Every read's bytes (the codes it answers) queue behind the bytes read before them, and
    the call returns once its own have passed. ``moved`` and ``waited_s`` say what it held.
    """

    bytes_per_s: float
    method: str = READ_METHOD
    moved: int = 0
    waited_s: float = 0.0
    _free_at: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> RateCap:
        """Patch the method on Mooncake's client class (every client of this process)."""
        store_class = _store_class()
        original: Callable[..., list[int]] = getattr(store_class, self.method)
        cap = self

        def capped(store: Any, *args: Any) -> list[int]:
            codes = original(store, *args)
            cap.hold(sum(code for code in codes if code > 0))
            return codes

        monkeypatch.setattr(store_class, self.method, capped)
        return self

    def hold(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more have passed the link."""
        with self._lock:
            now = time.monotonic()
            self._free_at = max(now, self._free_at) + nbytes / self.bytes_per_s
            wait = self._free_at - now
            self.moved += nbytes
            self.waited_s += wait
        time.sleep(wait)
