"""A Mooncake pool on this machine's loopback: a master and a store process.

Every process it starts, it stops, and each has a watchdog
(:mod:`~kvpool.connector.local.watchdog`) that SIGKILLs it should its starter die without
stopping it (a SIGKILL, the OOM killer). Binaries come from the
``mooncake-transfer-engine`` wheel (next to the interpreter in its virtualenv,
else on PATH). The master listens on loopback only; the store is started with
the Mooncake client environment of :mod:`kvpool.connector.contract.mooncake_env`
for a loopback address and talks to its peers over loopback, though Mooncake's
transfer engine keeps its own listeners open on every interface.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.connector.contract.mooncake_env import client_env
from kvpool.connector.contract.settings import parse_size
from kvpool.connector.local import tenant_quotas
from kvpool.connector.local.disk_tier import DiskTier
from kvpool.connector.local.ports import free_port as free_port  # re-exported for callers
from kvpool.connector.local.ports import held_port, release_port
from kvpool.connector.local.stopping import deferred
from kvpool.connector.local.watchdog import release, watch
from kvpool.connector.observability.logs import get_logger

LOOPBACK = "127.0.0.1"

logger = get_logger(__name__)


def find_binary(name: str) -> str:
    """``name`` next to this interpreter, else on PATH."""
    candidate = Path(sys.executable).with_name(name)
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found: install mooncake-transfer-engine(-non-cuda)")
    return found


def port_open(port: int, host: str = LOOPBACK) -> bool:
    """Whether something accepts connections on ``port`` of a loopback address."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


def log_tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a process's log ("" when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_for_port(
    port: int,
    timeout: float,
    process: subprocess.Popen[bytes] | None = None,
    host: str = LOOPBACK,
    log_path: Path | None = None,
) -> None:
    """Until something accepts connections on ``port`` of a loopback address; fails early if
    ``process`` exits. Either failure names the log (``log_path``) and ends with its end: a
    log removed with its folder afterwards still tells why."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(
                f"process exited with {process.returncode} before listening on {port}{_why(log_path)}"
            )
        if port_open(port, host):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s{_why(log_path)}")


def _why(log_path: Path | None) -> str:
    """The end of a failure's message: the log's path and its last lines."""
    return f"; the end of {log_path}:\n{log_tail(log_path)}" if log_path is not None else ""


def stop_process(process: subprocess.Popen[bytes] | None, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it lingers; then its watchdog goes. A stop signal meanwhile is
    raised once it is gone."""
    if process is None:
        return
    with deferred():
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout)
        release(process)


def kill_process(process: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL, without a word to anyone it serves; then reap it (and its watchdog goes)."""
    if process is None:
        return
    if process.poll() is None:
        process.kill()
        process.wait()
    release(process)


def start_logged(
    command: list[str], log_path: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``command`` in a session of its own, stdout and stderr appended to ``log_path``, with a
    watchdog that SIGKILLs it if this process ends without stopping it (stop it with
    :func:`stop_process` or :func:`kill_process`, which release the watchdog)."""
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        watch(process)
    except BaseException:
        kill_process(process)
        raise
    return process


@dataclass
class MooncakeMaster:
    """``mooncake_master`` bound to loopback on free ports, held (:func:`held_port`) from other
    draws until :meth:`stop`: through its start and across a restart after :meth:`kill`."""

    rpc_port: int = field(default_factory=held_port)
    metrics_port: int = field(default_factory=held_port)
    extra_args: tuple[str, ...] = ()
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvpool-master-")))
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{LOOPBACK}:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        return [
            find_binary("mooncake_master"),
            f"--rpc_address={LOOPBACK}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={LOOPBACK}",
            f"--metrics_port={self.metrics_port}",
            f"--http_metadata_server_host={LOOPBACK}",
            "--rpc_thread_num=4",
            *self.extra_args,
        ]

    def start(self, timeout: float = 30.0, *, wait_rpc: bool = True) -> MooncakeMaster:
        """Start and wait until it serves; an HA standby serves RPC only once it leads. A master
        that does not serve in time is stopped (it runs in a session of its own: nothing else
        would stop it)."""
        log = self.log_dir / "master.log"
        self.process = start_logged(self.command(), log)
        try:
            wait_for_port(self.metrics_port, timeout, self.process, log_path=log)
            if wait_rpc:
                wait_for_port(self.rpc_port, timeout, self.process, log_path=log)
        except BaseException:
            self.stop()
            raise
        return self

    def serving_rpc(self) -> bool:
        """Whether this master accepts RPC (an HA leader, or a single master)."""
        return port_open(self.rpc_port)

    def stop(self) -> None:
        """Stop it; its ports go back where :func:`held_port` drew them (a user's never were)."""
        stop_process(self.process)
        release_port(self.rpc_port, self.metrics_port)

    def kill(self) -> None:
        """SIGKILL: the master goes without a word to its clients (its drawn ports stay held)."""
        kill_process(self.process)

    def metrics(self) -> str:
        """The master's Prometheus exposition text."""
        with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
            return response.read().decode()

    def capacity_bytes(self) -> float:
        """Store memory mounted on this master (0 before a store mounts its segment)."""
        for line in self.metrics().splitlines():
            if line.startswith("master_total_capacity_bytes "):
                return float(line.split()[1])
        return 0.0

    def tenant_quotas(self) -> dict[str, tenant_quotas.TenantQuota]:
        """Each tenant's quota and charge as this master reports them (multi-tenant mode)."""
        return tenant_quotas.read_quotas(f"{LOOPBACK}:{self.metrics_port}")


@dataclass
class MooncakeStore:
    """``mooncake_client``: a store process contributing memory to the pool."""

    master_address: str
    segment_size: str = "256MB"
    host: str = LOOPBACK  # its transfer engine's address (its segment's name): a 127.x address
    port: int = field(default_factory=held_port)  # drawn: held until stop, as the master's
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvpool-store-")))
    process: subprocess.Popen[bytes] | None = None
    disk_tier: DiskTier | None = None  # a local disk tier under its memory: its directory goes on stop

    def command(self) -> list[str]:
        return [
            find_binary("mooncake_client"),
            f"--host={self.host}",
            f"--port={self.port}",
            f"--master_server_address={self.master_address}",
            "--metadata_server=P2PHANDSHAKE",
            "--protocol=tcp",
            f"--global_segment_size={self.segment_size}",
            *(() if self.disk_tier is None else self.disk_tier.store_args()),
        ]

    def start(self, master: MooncakeMaster | None = None, timeout: float = 60.0) -> MooncakeStore:
        env = {**os.environ, **client_env(self.host)}
        if self.disk_tier is not None:
            env.update(self.disk_tier.store_env())
        try:
            log = self.log_dir / "store.log"
            self.process = start_logged(self.command(), log, env)
            wait_for_port(self.port, timeout, self.process, self.host, log_path=log)
            if master is not None:
                wait_for_capacity(master, timeout, log_path=log)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        stop_process(self.process)
        release_port(self.port)
        if self.disk_tier is not None:
            self.disk_tier.remove()

    def kill(self) -> None:
        """SIGKILL: the store's memory leaves the pool at once (its disk tier stays until stop)."""
        kill_process(self.process)


def wait_for_capacity(
    master: MooncakeMaster, timeout: float, minimum: float = 1.0, *, log_path: Path | None = None
) -> None:
    """Until ``master`` reports at least ``minimum`` bytes of mounted store memory; a timeout
    names the store's log (``log_path``) and ends with its end."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if master.capacity_bytes() >= minimum:
                return
        except OSError:  # a master still starting answers nothing yet
            pass
        time.sleep(0.1)
    raise TimeoutError(f"no store segment mounted on {master.address} after {timeout}s{_why(log_path)}")


@dataclass
class LocalPool:
    """A master and one store on loopback; a context manager that stops both."""

    segment_size: str = "256MB"
    master_args: tuple[str, ...] = ()
    rpc_port: int = 0  # 0: a free port
    metrics_port: int = 0  # 0: a free port
    # Mooncake tenant -> quota in bytes: the master admits writes of these tenants only.
    tenant_quotas: Mapping[str, int] | None = None
    disk_tier: DiskTier | None = None  # the store's local disk tier
    # Keep the master's and the store's log folders after a clean stop or a failed start (the
    # command line pool, which tells where they are); those of a part that died on its own, or
    # of a store that did not start (its error names its log), are always kept.
    keep_logs: bool = False
    master: MooncakeMaster | None = None
    store: MooncakeStore | None = None
    _stopped: bool = field(default=False, init=False, repr=False)

    def __enter__(self) -> LocalPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> LocalPool:
        if self.disk_tier is not None and self.disk_tier.bucket_bytes > parse_size(self.segment_size) // 2:
            raise ValueError(
                "disk tier: a bucket (bucket_bytes) must be at most half the store's memory, or "
                "objects waiting for their bucket lose their memory copy before they are on disk"
            )
        self._stopped = False
        master = MooncakeMaster(
            rpc_port=self.rpc_port or held_port(), metrics_port=self.metrics_port or held_port()
        )
        extra = tuple(self.master_args)
        if self.tenant_quotas is not None:
            extra += tenant_quotas.write_policy(master.log_dir / "tenant_quotas.yaml", self.tenant_quotas)
        if self.disk_tier is not None:
            extra += self.disk_tier.master_args()
        master.extra_args = extra
        self.master = master.start()
        store = MooncakeStore(self.master.address, self.segment_size, disk_tier=self.disk_tier)
        try:
            self.store = store.start(self.master)
        except BaseException as exc:
            self.master.stop()
            if not self.keep_logs:  # a failed store's error names its log; nothing names the others
                shutil.rmtree(self.master.log_dir, ignore_errors=True)
                if store.process is None or not isinstance(exc, Exception):
                    shutil.rmtree(store.log_dir, ignore_errors=True)
            raise
        return self

    def stop(self) -> None:
        """Stop the store, then the master; their log folders go unless kept (``keep_logs``,
        or a part that had died on its own: its log says why). A stop signal meanwhile is raised
        once both are stopped."""
        with deferred():
            self._stop()

    def _stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        crashed = [
            f"{name} (exit status {process.returncode}, log in {log_dir})"
            for name, process, log_dir in self._exited_parts()
            if process.returncode != 0
        ]
        if self.store is not None:
            self.store.stop()
        if self.master is not None:
            self.master.stop()
        if crashed:
            logger.warning("local pool: %s", "; ".join(crashed))
        elif not self.keep_logs:
            for part in (self.store, self.master):
                if part is not None:
                    shutil.rmtree(part.log_dir, ignore_errors=True)

    def exited(self) -> list[str]:
        """The parts of the pool whose process has exited (empty while both run)."""
        return [
            f"{name} (exit status {process.returncode}, log in {log_dir})"
            for name, process, log_dir in self._exited_parts()
        ]

    def _exited_parts(self) -> list[tuple[str, subprocess.Popen[bytes], Path]]:
        """(name, process, log folder) of each part whose process has exited."""
        parts: tuple[tuple[str, MooncakeMaster | MooncakeStore | None], ...] = (
            ("master", self.master),
            ("store", self.store),
        )
        return [
            (name, part.process, part.log_dir)
            for name, part in parts
            if part is not None and part.process is not None and part.process.poll() is not None
        ]

    @property
    def address(self) -> str:
        assert self.master is not None
        return self.master.address
