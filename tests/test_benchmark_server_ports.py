"""A benchmark's vLLM server listens only once its model loads, tens of seconds after its port
is drawn: the port is held meanwhile (no other test process's server takes it), until it stops."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.serving import ApiServer
from kvpool.connector.local.ports import bindable, listenable

LOADING = [sys.executable, "-c", "import time; time.sleep(60)"]  # a server still loading its model


def test_a_drawn_server_port_is_held_until_the_server_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ApiServer, "command", lambda self: LOADING)
    server = ApiServer(tmp_path / "model", core=0, prefix_caching=False, log_path=tmp_path / "server.log")
    try:
        server.start()
        assert server.port and not bindable(server.port), "drawn, not yet bound: held"
    finally:
        server.stop()
    assert listenable(server.port), "stopped: let go"
