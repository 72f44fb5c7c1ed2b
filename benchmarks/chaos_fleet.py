"""The chaos run's fleet on loopback: a three-member etcd, HA masters, stores and vLLM servers.

Every process is started here, in a session (process group) of its own, and stopped by
:meth:`Fleet.stop` by PID, whatever state a fault left it in (a frozen store is continued
first); :meth:`Fleet.stop` runs in the caller's ``finally``. Each part can be hit on its own:
a store frozen, continued, killed and started again; the leading master killed and started
again as a standby; an etcd member killed and started again; a server killed with its
requests in flight and started again on its port; a server frozen and continued. A
co-located fleet (``colocated``) has no store processes: each server's connector holds a
segment of the pool in its own memory, so its peers read and write there. Parts are swapped
under a lock; samplers read a consistent view through :meth:`Fleet.servers_now`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.serving import ApiServer
from kvpool.connector.local.pool import MooncakeMaster, MooncakeStore
from kvpool.connector.local.ports import held_port
from testing import child_processes
from testing.etcd_cluster import EtcdCluster

STARTUP_TIMEOUT_S = 600.0
PoolPart = TypeVar("PoolPart", MooncakeMaster, MooncakeStore)
POOL_TIMEOUT_S = 120.0


@dataclass
class ServerSlot:
    """One server of the fleet: its current process, how many times it was restarted, and
    whether this process has served (its start-up is not sampled as steady state)."""

    server: ApiServer
    generation: int = 0
    ready: bool = False


@dataclass
class Fleet:
    """etcd x3, ``masters`` HA masters, ``stores`` store processes, ``servers`` vLLM servers;
    ``colocated``: each server holds a segment of ``segment_size`` too (and ``stores`` is 0)."""

    model: Path
    servers: int = 2
    masters: int = 2
    stores: int = 2
    segment_size: str = "256MB"
    colocated: bool = False
    kv_cache_bytes: int = 96 << 20
    transfer_config: dict[str, Any] = field(default_factory=dict)
    server_env: dict[str, str] = field(default_factory=dict)
    etcd: EtcdCluster | None = None
    master_list: list[MooncakeMaster] = field(default_factory=list)
    store_list: list[MooncakeStore | None] = field(default_factory=list)
    slots: list[ServerSlot] = field(default_factory=list)
    log_dirs: list[Path] = field(default_factory=list)  # every master's and store's
    _frozen: set[int] = field(default_factory=set)
    # Each frozen server's process (its group stopped), by index.
    _frozen_servers: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # Servers die with the thread that started them (PR_SET_PDEATHSIG names the thread, not
    # the process): every start goes through this one thread, which lives as long as the fleet.
    _spawner: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "chaos-spawner"))

    # --- the pool -------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """The pool's address for clients: ``etcd://`` every member."""
        assert self.etcd is not None
        return "etcd://" + self.etcd.endpoints()

    def ha_args(self) -> tuple[str, ...]:
        assert self.etcd is not None
        return ("--enable_ha=true", "--ha_backend_type=etcd", f"--etcd_endpoints={self.etcd.endpoints()}")

    def start_pool(self) -> None:
        self.etcd = EtcdCluster().start()
        self.master_list = [
            self._logged(MooncakeMaster(extra_args=self.ha_args())).start(wait_rpc=False)
            for _ in range(self.masters)
        ]
        leader = self.wait_for_leader(POOL_TIMEOUT_S)
        self.store_list = [
            self._logged(MooncakeStore(self.address, self.segment_size)).start() for _ in range(self.stores)
        ]
        self.wait_for_capacity(leader, self.stores, POOL_TIMEOUT_S)

    def _logged(self, part: PoolPart) -> PoolPart:
        self.log_dirs.append(part.log_dir)
        return part

    def leader(self) -> int | None:
        """The index of the one master serving RPC (None: none, or not yet one)."""
        leading = [
            i
            for i, m in enumerate(self.master_list)
            if m.process is not None and m.process.poll() is None and m.serving_rpc()
        ]
        return leading[0] if len(leading) == 1 else None

    def wait_for_leader(self, timeout: float, *, not_index: int | None = None) -> MooncakeMaster:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            index = self.leader()
            if index is not None and index != not_index:
                return self.master_list[index]
            time.sleep(0.05)
        raise TimeoutError(f"no master leads after {timeout:.0f}s")

    def segment_bytes(self) -> float:
        return float(self.segment_size.removesuffix("MB")) * (1 << 20)

    @property
    def segments(self) -> int:
        """How many segments the pool has when every part is up: stores', or servers'."""
        return self.stores + (self.servers if self.colocated else 0)

    def wait_for_capacity(self, leader: MooncakeMaster, segments: int, timeout: float) -> float:
        """Until ``leader`` has ``segments`` segments' memory mounted; the capacity."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                capacity = leader.capacity_bytes()
                if capacity >= segments * self.segment_bytes():
                    return capacity
            time.sleep(0.1)
        raise TimeoutError(f"{segments} segments not mounted on {leader.address} after {timeout:.0f}s")

    def freeze_store(self, index: int) -> None:
        store = self.store_list[index]
        assert store is not None and store.process is not None
        self._frozen.add(index)
        os.kill(store.process.pid, signal.SIGSTOP)

    def thaw_store(self, index: int) -> None:
        store = self.store_list[index]
        if store is not None and store.process is not None and store.process.poll() is None:
            os.kill(store.process.pid, signal.SIGCONT)
        self._frozen.discard(index)

    def kill_store(self, index: int) -> None:
        store = self.store_list[index]
        assert store is not None
        store.kill()

    def restart_store(self, index: int) -> None:
        """A new store process in slot ``index`` (its memory empty); waits until it is mounted."""
        replacement = self._logged(MooncakeStore(self.address, self.segment_size)).start()
        old = self.store_list[index]
        with self._lock:
            self.store_list[index] = replacement
        if old is not None:
            old.stop()
        self.wait_for_capacity(self.wait_for_leader(POOL_TIMEOUT_S), self.segments, POOL_TIMEOUT_S)

    def kill_leader(self) -> int:
        index = self.leader()
        if index is None:
            raise RuntimeError("no single master leads")
        self.master_list[index].kill()
        return index

    def restart_master(self, index: int) -> None:
        """Master ``index`` again, on its ports, as a standby (or leader, if none leads). Its
        ports stay held across the restart (a kill keeps them; a stop would let them go)."""
        old = self.master_list[index]
        old.kill()
        self.master_list[index] = MooncakeMaster(
            rpc_port=old.rpc_port,
            metrics_port=old.metrics_port,
            extra_args=self.ha_args(),
            log_dir=old.log_dir,
        ).start(wait_rpc=False)

    # --- the servers ------------------------------------------------------------------------
    def new_server(self, core: int, port: int) -> ApiServer:
        server = ApiServer(
            self.model,
            core,
            prefix_caching=True,
            kv_transfer_config=self.transfer_config,
            kv_cache_bytes=self.kv_cache_bytes,
            port=port,
        )
        if self.server_env:
            extra = self.server_env
            base_env = server.env

            def env() -> dict[str, str]:
                return {**base_env(), **extra}

            server.env = env  # type: ignore[method-assign]
        return server

    def _start(self, server: ApiServer) -> ApiServer:
        return self._spawner.submit(server.start).result()

    def start_servers(self, cores: list[int]) -> None:
        # Each slot's port is held until its server stops at the end: a restarted server binds it again.
        for i in range(self.servers):
            self.slots.append(ServerSlot(self._start(self.new_server(cores[i % len(cores)], held_port()))))

    def wait_servers(self) -> None:
        """Until every server serves (and, co-located, its segment is mounted)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for slot in self.slots:
            slot.server.wait_ready(deadline)
            slot.ready = True
        if self.colocated:
            self.wait_for_capacity(self.wait_for_leader(POOL_TIMEOUT_S), self.segments, POOL_TIMEOUT_S)

    def url(self, index: int) -> str:
        return self.slots[index].server.url

    def servers_now(self) -> list[tuple[int, int, ApiServer]]:
        """(index, generation, server) of every server that serves (or did, until a fault)."""
        with self._lock:
            return [(i, s.generation, s.server) for i, s in enumerate(self.slots) if s.ready]

    def freeze_server(self, index: int) -> None:
        """SIGSTOP the server's whole group (API server, engine core, worker and its segment)."""
        process = self.slots[index].server.process
        assert process is not None
        self._frozen_servers[index] = process
        os.killpg(process.pid, signal.SIGSTOP)

    def thaw_server(self, index: int) -> None:
        """SIGCONT the group stopped by :meth:`freeze_server` (gone already if it was killed)."""
        process = self._frozen_servers.pop(index, None)
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGCONT)

    def kill_server(self, index: int) -> None:
        """SIGKILL the server's whole group (API server, engine core, worker): no goodbye. Then,
        once the group is gone, the names it held in /dev/shm (vLLM's message queues)."""
        process = self.slots[index].server.process
        assert process is not None
        held = child_processes.kill_group(process.pid)
        process.wait(30)
        child_processes.wait_group_gone(process.pid)
        child_processes.remove_shared_memory(held)

    def restart_server(self, index: int) -> None:
        """A new server on the same port and core; waits until it serves."""
        old = self.slots[index].server
        replacement = self.new_server(old.core, old.port)
        replacement.log_path.unlink(missing_ok=True)  # it appends to the old server's log instead
        replacement.log_path = old.log_path
        self._start(replacement)
        slot = ServerSlot(replacement, self.slots[index].generation + 1)
        with self._lock:
            self.slots[index] = slot
        replacement.wait_ready(time.monotonic() + STARTUP_TIMEOUT_S)
        slot.ready = True

    # --- the end ------------------------------------------------------------------------------
    def stop(self, keep_logs_in: Path | None = None) -> None:
        """Every process started here, by PID (their groups for the servers); the servers' logs
        moved to ``keep_logs_in`` (else removed), the pool's log folders removed."""
        for index in list(self._frozen_servers):
            self.thaw_server(index)
        for slot in self.slots:
            with contextlib.suppress(Exception):
                slot.server.stop()
        for index in list(self._frozen):
            self.thaw_store(index)
        for store in self.store_list:
            if store is not None:
                store.stop()
        for master in self.master_list:
            master.stop()
        if self.etcd is not None:
            self.etcd.stop()
        self._spawner.shutdown()
        for index, slot in enumerate(self.slots):
            log = slot.server.log_path
            if log.exists() and keep_logs_in is not None:
                shutil.move(log, keep_logs_in / f"server-{index}.log")
            log.unlink(missing_ok=True)
        for folder in self.log_dirs:
            shutil.rmtree(folder, ignore_errors=True)
