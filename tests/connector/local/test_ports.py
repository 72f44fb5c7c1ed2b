"""Free ports are drawn below the kernel's ephemeral range, where no outgoing connection takes them."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

from kvpool.connector.local import ports


def test_ports_come_from_below_the_ephemeral_range_and_are_bindable() -> None:
    low, _ = ports.ephemeral_range()
    drawn = {ports.free_port() for _ in range(20)}
    if low - max(1024, low - ports.SPAN) >= 1024:
        assert all(max(1024, low - ports.SPAN) <= p < low for p in drawn), drawn
    assert len(drawn) > 1  # drawn at random, not the same port each time
    for port in drawn:
        with socket.socket() as sock:
            sock.bind((ports.LOOPBACK, port))  # free: a server binds it as it is


def test_an_unreadable_range_is_linuxs_default(tmp_path: Path) -> None:
    assert ports.ephemeral_range(tmp_path / "missing") == (32768, 60999)
    bogus = tmp_path / "range"
    bogus.write_text("not numbers\n")
    assert ports.ephemeral_range(bogus) == (32768, 60999)
    bogus.write_text("40000\t50000\n")
    assert ports.ephemeral_range(bogus) == (40000, 50000)


def test_a_taken_port_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind((ports.LOOPBACK, 0))
        taken.listen()
        port = taken.getsockname()[1]
        # A range too narrow to draw from: nothing is drawn, the kernel picks.
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (port + 1, port + 2))
        monkeypatch.setattr(ports, "SPAN", 1)
        monkeypatch.setattr(ports.secrets, "randbelow", lambda n: pytest.fail("drew from a narrow range"))
        assert ports.free_port() != port
        monkeypatch.setattr(ports.secrets, "randbelow", lambda n: 0)
        monkeypatch.setattr(ports, "SPAN", 2000)
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (port + 2000, port + 2001))
        assert ports.free_port() != port  # every draw hits the taken port: the kernel picks


def _held_port_drawn_again(monkeypatch: pytest.MonkeyPatch, port: int) -> int:
    """``free_port`` where every draw hits ``port`` (the kernel picks when none binds)."""
    low, _ = ports.ephemeral_range()
    start = max(1024, low - ports.SPAN)
    monkeypatch.setattr(ports.secrets, "randbelow", lambda n: port - start)
    return ports.free_port()


def test_a_held_port_is_never_drawn_again_and_its_server_still_binds_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hold = ports.PortHold.drawn()
    port = hold.port
    try:
        assert not ports.bindable(port)
        with pytest.raises(OSError):
            ports.PortHold(port)  # one hold per port
        assert _held_port_drawn_again(monkeypatch, port) != port
        for _ in range(2):  # a server with SO_REUSEADDR listens on it, again after it stops
            with socket.socket() as server:
                server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                server.bind((ports.LOOPBACK, port))
                server.listen()
                client = socket.create_connection((ports.LOOPBACK, port), timeout=5)
                accepted, _ = server.accept()
                client.close()  # the client closes first: no TIME_WAIT stays on the port
                accepted.close()
            assert not ports.bindable(port), "held while its server is down"
    finally:
        hold.release()
    assert ports.bindable(port)
    assert _held_port_drawn_again(monkeypatch, port) == port  # released: drawn like any other


@pytest.mark.mooncake
def test_a_master_starts_and_restarts_on_held_ports() -> None:
    from kvpool.connector.local.pool import MooncakeMaster

    rpc, metrics = ports.PortHold.drawn(), ports.PortHold.drawn()
    try:
        for _ in range(2):  # started, killed, started again on the same ports
            master = MooncakeMaster(rpc_port=rpc.port, metrics_port=metrics.port)
            try:
                master.start(30)
                assert master.serving_rpc()
            finally:
                master.kill()
                shutil.rmtree(master.log_dir, ignore_errors=True)
            assert not ports.bindable(rpc.port) and not ports.bindable(metrics.port)
    finally:
        rpc.release()
        metrics.release()


def test_a_held_port_is_kept_from_every_draw_until_released(monkeypatch: pytest.MonkeyPatch) -> None:
    port = ports.held_port()
    try:
        assert not ports.bindable(port)  # a plain bind (another server's) is refused
        assert _held_port_drawn_again(monkeypatch, port) != port
    finally:
        ports.release_port(port)
    assert ports.bindable(port)
    ports.release_port(port, None)  # released twice, or never held: nothing happens
    with socket.socket() as given:  # a port a user gave (never held) stays as it is
        given.bind((ports.LOOPBACK, 0))
        ports.release_port(given.getsockname()[1])
        assert given.getsockname()[1] != 0


def _serves_on(sock: socket.socket) -> bool:
    """Whether the listening ``sock`` accepts a connection (the client closes first)."""
    port = sock.getsockname()[1]
    with socket.create_connection((ports.LOOPBACK, port), timeout=5) as client:
        accepted, _ = sock.accept()
        client.close()
        accepted.close()
    return True


@pytest.mark.parametrize("reuse_port", [False, True])
def test_vllms_api_server_socket_binds_a_held_port(reuse_port: bool) -> None:
    """vLLM's OpenAI server binds its socket before its model loads and listens once it has."""
    from vllm.entrypoints.launchers.launcher import create_server_socket

    port = ports.held_port()
    try:
        with create_server_socket((ports.LOOPBACK, port), reuse_port=reuse_port) as sock:
            assert not ports.bindable(port)
            sock.listen()
            assert _serves_on(sock)
    finally:
        ports.release_port(port)


def test_a_gloo_rendezvous_store_binds_a_held_port() -> None:
    """The ``tcp://`` init method's store (rank 0 binds it once its interpreter is up)."""
    from datetime import timedelta

    import torch.distributed as dist

    port = ports.held_port()
    try:
        store = dist.TCPStore(ports.LOOPBACK, port, 1, True, timeout=timedelta(seconds=30))
        store.set("key", "value")
        assert dist.TCPStore(ports.LOOPBACK, port, 1, False).get("key") == b"value"
        del store
    finally:
        ports.release_port(port)


@pytest.mark.mooncake
def test_drawn_master_and_store_ports_are_held_until_stop() -> None:
    """Drawn at construction, bound only once started: held meanwhile, and after a kill (a
    restart binds them again); let go at stop. Ports a user gives are never held."""
    from kvpool.connector.local.pool import MooncakeMaster, MooncakeStore

    master = MooncakeMaster()
    store = MooncakeStore(master.address, "32MB")
    drawn = [master.rpc_port, master.metrics_port, store.port]
    try:
        assert not any(ports.bindable(p) for p in drawn), "drawn, not yet bound: held"
        master.start(30)
        store.start(master, 60)  # it serves: its segment is mounted on the master
        assert master.capacity_bytes() > 0
        store.kill()
        master.kill()
        assert not any(ports.bindable(p) for p in drawn), "killed: held for a restart"
    finally:
        store.stop()
        master.stop()
        shutil.rmtree(master.log_dir, ignore_errors=True)
        shutil.rmtree(store.log_dir, ignore_errors=True)
    assert all(ports.listenable(p) for p in drawn), "stopped: let go"
    given = ports.free_port()
    unstarted = MooncakeMaster(rpc_port=given, metrics_port=given)
    unstarted.stop()  # never started: nothing to stop
    shutil.rmtree(unstarted.log_dir, ignore_errors=True)
    assert ports.bindable(given)


@pytest.mark.mooncake
def test_a_local_pool_holds_the_ports_it_draws_until_its_master_binds_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvpool.connector.local import pool as local_pool

    free_at_start: list[bool] = []
    start = local_pool.MooncakeMaster.start

    def observed(master: local_pool.MooncakeMaster, *args: object, **kwargs: object) -> object:
        free_at_start.extend(ports.bindable(p) for p in (master.rpc_port, master.metrics_port))
        return start(master, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(local_pool.MooncakeMaster, "start", observed)
    with local_pool.LocalPool(segment_size="32MB") as drawn:
        assert drawn.master is not None
        rpc, metrics = drawn.master.rpc_port, drawn.master.metrics_port
    assert free_at_start == [False, False], "drawn ports were free for anyone until the master bound them"
    assert ports.listenable(rpc) and ports.listenable(metrics)  # let go at stop
    given = [ports.free_port(), ports.free_port()]
    with local_pool.LocalPool(segment_size="32MB", rpc_port=given[0], metrics_port=given[1]) as pool:
        assert pool.address == f"{ports.LOOPBACK}:{given[0]}"
    assert free_at_start[2:] == [True, True]  # given ports: not held, as before
