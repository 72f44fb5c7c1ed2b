"""Debian's ``etcd`` as a cluster of members on loopback, each one killed and restarted at will.

Every member listens on 127.0.0.1 only (free ports), keeps its data in a folder of its own
(a restarted member rejoins with its data), and runs in a session of its own; ``stop`` ends
every member this object started, by PID, and removes the folders.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.connector.local.pool import LOOPBACK, kill_process, start_logged, stop_process
from kvpool.connector.local.pool import port_open as _port_open
from kvpool.connector.local.ports import PortHold

CLUSTER_TOKEN = "kvpool-chaos"


@dataclass
class EtcdMember:
    """One member: its name, ports, data folder and process. Its ports are held
    (:class:`PortHold`) until :meth:`release`: no other draw takes them while it is down."""

    name: str
    workdir: Path
    client_hold: PortHold = field(default_factory=PortHold.drawn)
    peer_hold: PortHold = field(default_factory=PortHold.drawn)
    process: subprocess.Popen[bytes] | None = None

    @property
    def client_port(self) -> int:
        return self.client_hold.port

    @property
    def peer_port(self) -> int:
        return self.peer_hold.port

    def release(self) -> None:
        self.client_hold.release()
        self.peer_hold.release()

    @property
    def endpoint(self) -> str:
        return f"{LOOPBACK}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{LOOPBACK}:{self.peer_port}"

    def command(self, initial_cluster: str) -> list[str]:
        binary = shutil.which("etcd")
        if binary is None:
            raise FileNotFoundError("etcd not installed: run scripts/setup.sh (etcd-server)")
        client = f"http://{self.endpoint}"
        return [
            binary,
            "--name", self.name,
            "--data-dir", str(self.workdir / "data"),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", initial_cluster,
            "--initial-cluster-token", CLUSTER_TOKEN,
            "--initial-cluster-state", "new",
        ]  # fmt: skip

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class EtcdCluster:
    """``size`` etcd members forming one cluster on loopback."""

    size: int = 3
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvpool-etcd-cluster-")))
    members: list[EtcdMember] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.members:
            self.members = [EtcdMember(f"m{i}", self.workdir / f"m{i}") for i in range(self.size)]
            for member in self.members:
                member.workdir.mkdir(parents=True, exist_ok=True)

    @property
    def initial_cluster(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    def endpoints(self, separator: str = ",") -> str:
        """Every member's client endpoint, ``host:port`` joined by ``separator``."""
        return separator.join(m.endpoint for m in self.members)

    def start(self, timeout: float = 60.0) -> EtcdCluster:
        """Start every member (they elect a leader among themselves); wait until each serves."""
        try:
            for index in range(len(self.members)):
                self._launch(index)
            deadline = time.monotonic() + timeout
            for index in range(len(self.members)):
                self.wait_healthy(index, deadline - time.monotonic())
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, index: int) -> None:
        member = self.members[index]
        member.process = start_logged(member.command(self.initial_cluster), member.workdir / "etcd.log")

    def wait_healthy(self, index: int, timeout: float) -> None:
        """Until member ``index`` answers ``/health`` as healthy (the cluster has a leader)."""
        import urllib.request

        member = self.members[index]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if member.process is not None and member.process.poll() is not None:
                raise RuntimeError(f"etcd {member.name} exited with {member.process.returncode}")
            if _port_open(member.client_port):
                try:
                    with urllib.request.urlopen(f"http://{member.endpoint}/health", timeout=2) as reply:
                        if b'"health":"true"' in reply.read():
                            return
                except OSError:
                    pass
            time.sleep(0.1)
        raise TimeoutError(f"etcd {member.name} not healthy after {timeout:.0f}s")

    def kill(self, index: int) -> None:
        """SIGKILL member ``index`` (its data folder stays)."""
        kill_process(self.members[index].process)

    def restart(self, index: int, timeout: float = 30.0) -> None:
        """Start member ``index`` again on its ports and data; wait until it serves."""
        if self.members[index].running():
            raise RuntimeError(f"etcd {self.members[index].name} still runs")
        self._launch(index)
        self.wait_healthy(index, timeout)

    def stop(self) -> None:
        for member in self.members:
            stop_process(member.process)
            member.release()
        shutil.rmtree(self.workdir, ignore_errors=True)
