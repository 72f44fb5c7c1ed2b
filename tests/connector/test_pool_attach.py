"""A client started while its master is down: out of the pool at once (every call a fast
miss), never a setup in-process while the master does not serve (Mooncake's setup holds
the GIL), and in the pool once the master serves, with the memory it registered before."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvpool.connector.contract.mooncake_env import configure_client_process
from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.local.pool import (
    LOOPBACK,
    MooncakeMaster,
    MooncakeStore,
    stop_process,
)
from kvpool.connector.local.ports import PortHold
from kvpool.connector.pool_attach import (
    ATTACH_INTERVAL_S,
    Attacher,
    accepts_connections,
    endpoints,
    sets_up_in_a_child,
    trial_setup_deadline_s,
)
from kvpool.connector.pool_client import CODE_RPC_FAILED, PoolClient, open_client
from testing.etcd_cluster import EtcdCluster
from testing.mooncake_faults import mooncake_store_class
from testing.pool_store import put_bytes

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(300)]

#: A listener that accepts every connection and never answers: a master that does not serve.
SILENT_LISTENER = """
import socket, sys
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", int(sys.argv[1])))
server.listen(64)
held = []
while True:
    held.append(server.accept()[0])
"""


def test_the_endpoints_of_a_master_address() -> None:
    assert endpoints("127.0.0.1:50051") == [("127.0.0.1", 50051)]
    assert endpoints("etcd://10.0.0.1:2379,etcd-1.ns.svc:2379") == [
        ("10.0.0.1", 2379),
        ("etcd-1.ns.svc", 2379),
    ]
    assert endpoints("[::1]:50051") == [("::1", 50051)]
    assert endpoints("no-port") == []


@pytest.fixture
def setups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each Mooncake ``setup`` of this process, by master address (a child's are not seen)."""
    store_class = mooncake_store_class()
    original = store_class.setup
    seen: list[str] = []

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(str(args[6]))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(store_class, "setup", counted)
    return seen


@pytest.fixture
def rpc_port(held_ports: Callable[[], int]) -> int:
    """Nothing listens on it until a test starts its master: no other test process's server either."""
    return held_ports()


def _wait(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.1)


def test_a_client_started_without_its_master_joins_once_it_serves(rpc_port: int, setups: list[str]) -> None:
    address = f"{LOOPBACK}:{rpc_port}"
    settings = ConnectorSettings.parse({"master_server_address": address, "store_timeout_s": 1})
    listener: subprocess.Popen[bytes] | None = None
    master = MooncakeMaster(rpc_port=rpc_port)
    store = MooncakeStore(address, "32MB")
    client: PoolClient | None = None
    other: PoolClient | None = None
    try:
        # Nothing listens: out of the pool at once, with no setup tried.
        assert not accepts_connections(address)
        client = open_client(settings, global_segment_size=0, attach_later=True)
        assert not client.attached and setups == []
        buffer = np.zeros(4096, dtype=np.uint8)
        client.register(buffer.ctypes.data, buffer.nbytes)  # remembered until it joins
        assert client.presence(["k"]) == ([False], "rpc_failed")
        assert client.get_into(["k"], [[buffer.ctypes.data]], [[64]]) == [CODE_RPC_FAILED]
        assert client.reserve(["k"], [64]) == [CODE_RPC_FAILED]
        # A master that accepts connections and never answers: the client asks it from child
        # processes only; no setup runs here (it would hold this process's GIL).
        listener = subprocess.Popen([sys.executable, "-c", SILENT_LISTENER, str(rpc_port)])
        _wait(lambda: accepts_connections(address), 30, "the silent listener listens")
        attacher = client._attacher
        assert attacher is not None
        tried = attacher.failures
        _wait(lambda: tried.total() > tried[Attacher.NO_CONNECTION], 6 * ATTACH_INTERVAL_S + 60, "a try")
        assert not client.attached and setups == []
        assert tried.total() == tried[Attacher.NO_CONNECTION] + tried[Attacher.TRIAL_FAILED]
        stop_process(listener)
        # The master serves: the client joins (one setup here), its memory registered.
        master.start()
        store.start(master)
        _wait(lambda: client is not None and client.attached, 6 * ATTACH_INTERVAL_S + 60, "joined")
        assert setups == [address]
        other = open_client(settings, global_segment_size=0)
        payload = bytes(range(64))
        assert put_bytes(other, "k", payload) == 0
        assert client.presence(["k"]) == ([True], None)
        assert client.get_into(["k"], [[buffer.ctypes.data]], [[64]]) == [64]
        assert buffer[:64].tobytes() == payload
    finally:
        for pool_client in (client, other):
            if pool_client is not None:
                pool_client.close()
        stop_process(listener)
        store.stop()
        master.stop()
        for log_dir in (master.log_dir, store.log_dir):
            shutil.rmtree(log_dir, ignore_errors=True)


def test_a_closed_client_stops_trying(rpc_port: int) -> None:
    settings = ConnectorSettings.parse({"master_server_address": f"{LOOPBACK}:{rpc_port}"})
    client = open_client(settings, global_segment_size=0, attach_later=True)
    attacher = client._attacher
    assert attacher is not None
    client.close()
    _wait(lambda: not attacher._thread.is_alive(), ATTACH_INTERVAL_S + 30, "the attach thread ended")
    assert not client.attach() and not client.attached


@pytest.fixture
def ha_master_address() -> Iterator[str]:
    """One Mooncake master leading through a one-member etcd, both on loopback: ``etcd://...``."""
    etcd = EtcdCluster(size=1)
    rpc = PortHold.drawn()
    master: MooncakeMaster | None = None
    try:
        etcd.start()
        ha_args = ("--enable_ha=true", "--ha_backend_type=etcd", f"--etcd_endpoints={etcd.endpoints()}")
        master = MooncakeMaster(rpc_port=rpc.port, extra_args=ha_args)
        master.start(timeout=60)  # its RPC port opens once it leads
        yield f"etcd://{etcd.endpoints()}"
    finally:
        if master is not None:
            master.stop()
            shutil.rmtree(master.log_dir, ignore_errors=True)
        rpc.release()
        etcd.stop()


def test_a_trial_against_an_ha_master_ends_within_its_deadline(
    ha_master_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trial child exits without tearing its client down: Mooncake's teardown of a client
    of an HA master waits out its leader watch (up to 30 s), past the trial's deadline with a
    short store timeout, and such a client would never join the pool."""
    settings = ConnectorSettings.parse({"master_server_address": ha_master_address, "store_timeout_s": 5})
    child_env: dict[str, str] = {}  # the child's Mooncake variables are this process's
    configure_client_process(settings.tcp_bind_address, child_env, store_timeout_s=settings.store_timeout_s)
    for name, value in child_env.items():
        monkeypatch.setenv(name, value)
    deadline_s = trial_setup_deadline_s(settings)
    assert deadline_s < 30
    assert sets_up_in_a_child(settings, deadline_s)
