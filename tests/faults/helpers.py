"""Small helpers for the fault suite: etcd, an HA pool, a bounded request stream, /proc sampling.

Everything binds to 127.0.0.1 and everything started here is stopped by its owner's
``stop`` (the fixtures call it in ``finally``). Every wait has a deadline.
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import random
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.connector.local.pool import (
    LOOPBACK,
    MooncakeMaster,
    MooncakeStore,
    start_logged,
    stop_process,
    wait_for_capacity,
    wait_for_port,
)
from kvpool.connector.local.ports import PortHold, held_port, release_port
from testing.engine import worker_of
from testing.worker import transfer_records, transfers_in_flight

BLOCK = 32
PREFIX_BLOCKS = 9
PREFIX_TOKENS = PREFIX_BLOCKS * BLOCK  # 288: what a pool hit on a shared prefix serves
MAX_TOKENS = 8


# --- prompts -------------------------------------------------------------------------


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def prompt(prefix: int, suffix: int) -> list[int]:
    """Prefix ``prefix`` (288 tokens, shared) followed by suffix ``suffix`` of that prefix."""
    tail = _tokens(10_000 + 97 * prefix + suffix, 24 + 8 * (suffix % 3))
    return _tokens(prefix, PREFIX_TOKENS) + tail


#: Every (prefix, suffix) the suite serves; the session computes each one's reference once.
PREFIXES, SUFFIXES = 4, 4
UNIVERSE = [(p, s) for p in range(PREFIXES) for s in range(SUFFIXES)]


def stream(count: int, prefixes: int = 3, suffixes: int = SUFFIXES, start: int = 0) -> list[tuple[int, int]]:
    """(prefix, suffix) of request ``start .. start+count-1`` of a round-robin shared-prefix stream."""
    return [((j % prefixes), (j // prefixes) % suffixes) for j in range(start, start + count)]


# --- etcd and an HA pool ---------------------------------------------------------------


@dataclass
class Etcd:
    """Debian's ``etcd`` as a one-member cluster on loopback."""

    client_port: int = field(default_factory=held_port)  # drawn: held until stop
    peer_port: int = field(default_factory=held_port)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvpool-etcd-")))
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{LOOPBACK}:{self.client_port}"

    def start(self, timeout: float = 30.0) -> Etcd:
        binary = shutil.which("etcd")
        if binary is None:
            raise FileNotFoundError("etcd not installed: run scripts/setup.sh (etcd-server)")
        client = f"http://{LOOPBACK}:{self.client_port}"
        peer = f"http://{LOOPBACK}:{self.peer_port}"
        command = [
            binary,
            "--data-dir",
            str(self.workdir / "data"),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"default={peer}",
        ]
        log = self.workdir / "etcd.log"
        self.process = start_logged(command, log)
        wait_for_port(self.client_port, timeout, self.process, log_path=log)
        return self

    def stop(self) -> None:
        stop_process(self.process)
        release_port(self.client_port, self.peer_port)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def clear(self, timeout: float = 10.0) -> None:
        """Delete every key (through etcd's JSON gateway): the next masters elect at once,
        with no leader key of masters gone before them."""
        everything = base64.b64encode(b"\0").decode()
        request = urllib.request.Request(
            f"http://{self.endpoint}/v3/kv/deleterange",
            data=json.dumps({"key": everything, "range_end": everything}).encode(),
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()


_process_etcd: Etcd | None = None


def process_etcd() -> Etcd:
    """The one etcd of this process's HA pools, started on first use, stopped at exit.

    Mooncake's client joins one etcd per process: a client of a second address fails its
    set-up ("Etcd client already connected"). So the pools a process runs (one after another)
    take turns on one etcd, each from an empty keyspace."""
    global _process_etcd
    if _process_etcd is None or _process_etcd.process is None or _process_etcd.process.poll() is not None:
        _process_etcd = Etcd().start()
        atexit.register(_process_etcd.stop)
    _process_etcd.clear()
    return _process_etcd


@dataclass
class HAPool:
    """Two masters with ``--enable_ha`` electing a leader through the process's etcd
    (:func:`process_etcd`), one store. A standby binds its RPC port only once it leads:
    each master's RPC port is held (:class:`PortHold`) until :meth:`stop`."""

    segment_size: str = "256MB"
    etcd: Etcd | None = None
    masters: list[MooncakeMaster] = field(default_factory=list)
    store: MooncakeStore | None = None
    rpc_holds: list[PortHold] = field(default_factory=list)

    @property
    def address(self) -> str:
        assert self.etcd is not None
        return f"etcd://{self.etcd.endpoint}"

    def ha_args(self) -> tuple[str, ...]:
        assert self.etcd is not None
        return ("--enable_ha=true", "--ha_backend_type=etcd", f"--etcd_endpoints={self.etcd.endpoint}")

    def start(self, timeout: float = 60.0) -> HAPool:
        try:
            self.etcd = process_etcd()
            for _ in range(2):
                self.rpc_holds.append(PortHold.drawn())
                master = MooncakeMaster(rpc_port=self.rpc_holds[-1].port, extra_args=self.ha_args())
                self.masters.append(master.start(wait_rpc=False))
            leader = self.wait_for_leader(timeout)
            self.store = MooncakeStore(self.address, self.segment_size).start()
            wait_for_capacity(leader, timeout)
            self.wait_for_clients(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_for_clients(self, timeout: float) -> None:
        """Until a client sets up through etcd (the leader's address there, its RPC answering):
        on a loaded machine that can come after the leader mounts the store's memory.

        Each try is the connector's trial client, in a child that exits without closing it:
        closing a client of an HA master waits out Mooncake's leader watch (up to 30 s)."""
        from kvpool.connector.contract.mooncake_env import configure_client_process
        from kvpool.connector.contract.settings import ConnectorSettings
        from kvpool.connector.pool_attach import sets_up_in_a_child, trial_setup_deadline_s

        settings = ConnectorSettings.parse({"master_server_address": self.address})
        configure_client_process(settings.tcp_bind_address, store_timeout_s=settings.store_timeout_s)
        deadline = time.monotonic() + timeout
        while not sets_up_in_a_child(settings, trial_setup_deadline_s(settings)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no client set up through {self.address} after {timeout}s")
            time.sleep(0.5)

    def leader(self) -> MooncakeMaster | None:
        live = [m for m in self.masters if m.process is not None and m.process.poll() is None]
        leading = [m for m in live if m.serving_rpc()]
        return leading[0] if len(leading) == 1 else None

    def wait_for_leader(self, timeout: float) -> MooncakeMaster:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leader = self.leader()
            if leader is not None:
                return leader
            time.sleep(0.05)
        raise TimeoutError(f"no master leads after {timeout}s")

    def stop(self) -> None:
        if self.store is not None:
            self.store.stop()
            shutil.rmtree(self.store.log_dir, ignore_errors=True)
        for master in self.masters:
            master.stop()
            shutil.rmtree(master.log_dir, ignore_errors=True)
        for hold in self.rpc_holds:
            hold.release()


@dataclass
class SinglePool:
    """One master on fixed loopback ports, so it can be killed and restarted under its
    clients (they reconnect to the same address), and one store process.

    Its ports are held from its creation to :meth:`stop`: while its master is not running
    (not started yet, or killed), no other test's draw hands them out.
    """

    segment_size: str = "256MB"
    rpc_hold: PortHold = field(default_factory=PortHold.drawn)
    metrics_hold: PortHold = field(default_factory=PortHold.drawn)
    master: MooncakeMaster | None = None
    store: MooncakeStore | None = None
    _logs: list[Path] = field(default_factory=list)

    @property
    def rpc_port(self) -> int:
        return self.rpc_hold.port

    @property
    def metrics_port(self) -> int:
        return self.metrics_hold.port

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.rpc_port}"

    def start(self) -> SinglePool:
        try:
            self.start_master()
            self.start_store()
        except BaseException:
            self.stop()
            raise
        return self

    def start_master(self, *args: str, timeout: float = 30.0) -> MooncakeMaster:
        self.master = MooncakeMaster(rpc_port=self.rpc_port, metrics_port=self.metrics_port, extra_args=args)
        self._logs.append(self.master.log_dir)
        return self.master.start(timeout)

    def kill_master(self) -> None:
        assert self.master is not None
        self.master.kill()

    def restart_master(self, *args: str, timeout: float = 30.0) -> None:
        """Kill the master and start an empty one on the same ports; wait for the store to remount."""
        self.kill_master()
        self.start_master(*args, timeout=timeout)
        if self.store is not None and self.store.process is not None and self.store.process.poll() is None:
            wait_for_capacity(self.master, timeout)  # type: ignore[arg-type]

    def start_store(self, segment_size: str | None = None, timeout: float = 60.0) -> MooncakeStore:
        self.store = MooncakeStore(self.address, segment_size or self.segment_size)
        self._logs.append(self.store.log_dir)
        self.store.start()
        assert self.master is not None
        wait_for_capacity(self.master, timeout)
        return self.store

    def kill_store(self) -> None:
        assert self.store is not None
        self.store.kill()

    def key_count(self) -> int:
        assert self.master is not None
        for line in self.master.metrics().splitlines():
            if line.startswith("master_key_count "):
                return int(float(line.split()[1]))
        raise AssertionError("master_key_count missing from the master's metrics")

    def stop(self) -> None:
        if self.store is not None:
            self.store.stop()
        if self.master is not None:
            self.master.stop()
        self.rpc_hold.release()
        self.metrics_hold.release()
        for path in self._logs:
            shutil.rmtree(path, ignore_errors=True)


# --- a bounded request stream on an in-process engine ----------------------------------------


class RequestHung(RuntimeError):
    """A request did not finish within its deadline."""


@dataclass
class Served:
    """One request of a stream."""

    key: tuple[int, int]
    tokens: list[int]
    cached: int
    started: float
    finished: float

    @property
    def seconds(self) -> float:
        return self.finished - self.started

    @property
    def hit(self) -> bool:
        return self.cached > 0


class Engine:
    """A real in-process vLLM CPU engine whose local prefix cache is emptied before each request.

    Every cached token of a request therefore came from the pool, and every request
    looks the pool up. ``serve`` steps the engine itself and gives up (aborting the
    request and raising ``RequestHung``) past a deadline, so nothing waits forever.
    """

    def __init__(self, model: Path, kv_transfer_config: dict[str, Any] | None, *, log_stats: bool = False):
        from testing.engine import EngineOptions, create_llm

        self.llm = create_llm(
            EngineOptions(
                model=str(model),
                kv_transfer_config=kv_transfer_config,
                max_num_seqs=2,
                disable_log_stats=not log_stats,
            )
        )
        self._ids = 0

    def serve(self, key: tuple[int, int], *, deadline_s: float = 60.0) -> Served:
        from testing.engine import sampling_params

        engine = self.llm.llm_engine
        # The pool a request meets holds every earlier request's saves: a save is asynchronous
        # (its writes outlive its step), and a lookup racing one would miss at random.
        self.wait_for_saves()
        self._reset_local_cache(engine, deadline_s)
        params = sampling_params(MAX_TOKENS)
        self._ids += 1
        request_id = f"fault-{self._ids}"
        started = time.monotonic()
        engine.add_request(request_id, {"prompt_token_ids": prompt(*key)}, params)
        while True:
            outputs = engine.step()
            for out in outputs:
                if out.request_id == request_id and out.finished:
                    return Served(
                        key,
                        list(out.outputs[0].token_ids),
                        int(out.num_cached_tokens or 0),
                        started,
                        time.monotonic(),
                    )
            if time.monotonic() - started > deadline_s:
                # Not aborted: an abort during a pool load is a fault of its own (test_abort).
                raise RequestHung(f"request {key} unfinished after {time.monotonic() - started:.1f}s")
            if not outputs:
                time.sleep(0.002)  # e.g. waiting for an asynchronous load: do not spin

    @staticmethod
    def _reset_local_cache(engine: Any, deadline_s: float) -> None:
        deadline = time.monotonic() + deadline_s
        while not engine.reset_prefix_cache():
            # Blocks still held (e.g. an asynchronous load winding down): let a step release them.
            if time.monotonic() > deadline:
                raise RequestHung("the local prefix cache never became free")
            engine.step()
            time.sleep(0.01)

    def transfers(self) -> list[Any]:
        from testing.engine import worker_connector

        worker = worker_connector()
        return list(worker.recording.transfers) if worker is not None else []

    def lookups(self) -> list[Any]:
        from testing.engine import scheduler_connector

        sched = scheduler_connector(self.llm)
        return list(sched.recording.lookups) if sched is not None else []

    def stored_prefix_keys(self, key: tuple[int, int]) -> int:
        """How many keys of ``key``'s shared prefix the pool holds (asked through the engine's client)."""
        from testing.engine import scheduler_connector, scheduler_of
        from testing.prompts import pool_keys

        sched = scheduler_connector(self.llm)
        keys = pool_keys(sched.keyspace, prompt(*key), len(sched.layout.groups), range(PREFIX_BLOCKS))
        return sum(scheduler_of(sched).client.exists(keys))

    def wait_for_saves(self) -> None:
        """Until this engine's saves in flight have published or been given up on (at their
        deadline)."""
        from testing.engine import worker_connector

        worker = worker_connector()
        if worker is not None:
            worker_of(worker).wait_for_saves()

    def undrained_failures(self, timeout: float = 30.0) -> Counter[str]:
        """Failures recorded but not yet handed to vLLM's metrics (after in-flight saves end)."""
        from concurrent.futures import wait

        from testing.engine import worker_connector

        worker = worker_connector()
        if worker is None:
            return Counter()
        side = worker_of(worker)
        pending = transfers_in_flight(side)
        wait(pending, timeout=timeout)
        return failures_by_reason(transfer_records(side))

    def failure_series(self) -> Counter[str]:
        """``vllm:kvpool_failures`` by reason, as vLLM's metrics registry holds it."""
        out: Counter[str] = Counter()
        for metric in self.llm.get_metrics():
            if metric.name == "vllm:kvpool_failures":
                out[metric.labels["reason"]] += int(metric.value)
        return out

    def close(self) -> None:
        from testing.engine import shutdown_llm

        shutdown_llm(self.llm)


def failures_by_reason(transfers: Iterable[Any], operation: str | None = None) -> Counter[str]:
    out: Counter[str] = Counter()
    for t in transfers:
        if operation is None or t.operation == operation:
            out.update(t.failures)
    return out


def outlast_fail_fast() -> None:
    """Wait out the client's fail-fast window after an outage (a bounded sleep, no assertion).

    After a batch whose every key failed its RPC, the connector drops transfers for
    ``UNREACHABLE_BACKOFF_S`` instead of waiting seconds per call; saves in that window are
    skipped (future misses), so a refill is judged after it.
    """
    from kvpool.connector.pool_client import UNREACHABLE_BACKOFF_S

    time.sleep(UNREACHABLE_BACKOFF_S)


def serve_until_hits(
    engine: Engine, keys: Sequence[tuple[int, int]], hits: int = 1, deadline_s: float = 60.0
) -> list[Served]:
    """Serve ``keys`` in order until ``hits`` of them hit the pool (at most all of them)."""
    served: list[Served] = []
    for key in keys:
        if served:
            engine.wait_for_saves()  # a save is asynchronous: the next lookup sees what it saved
        served.append(engine.serve(key, deadline_s=deadline_s))
        if sum(s.hit for s in served) >= hits:
            break
    return served


def check_outputs(served: Sequence[Served], references: dict[tuple[int, int], list[int]]) -> None:
    wrong = [(s.key, s.tokens, references[s.key]) for s in served if s.tokens != references[s.key]]
    assert not wrong, f"{len(wrong)} outputs differ from their references, first: {wrong[0]}"


# --- /proc sampling (soak) ------------------------------------------------------------------


@dataclass(frozen=True)
class ProcSample:
    rss_bytes: int
    threads: int
    fds: int


def sample(pid: int) -> ProcSample:
    rss = threads = 0
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return ProcSample(rss, threads, len(os.listdir(f"/proc/{pid}/fd")))
