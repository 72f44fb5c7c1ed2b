"""Free ports are drawn below the kernel's ephemeral range, where no outgoing connection takes them."""

from __future__ import annotations

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
