"""``kvpool-local-pool`` as a process: the JSON it prints, its stops, and its refusals.

Serving vLLM's OpenAI server from it is ``tests/connector/local/test_serving_local_pool.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.local.pool import port_open
from kvpool.connector.local.ports import free_port
from testing.child_processes import children, kill_leftovers, running

pytestmark = pytest.mark.mooncake

COMMAND = [sys.executable, "-m", "kvpool.connector.local.pool_command"]
STARTUP_S = 120.0
#: The log folders of the pools a test started (the command keeps them and says where).
_LOG_FOLDERS: list[Path] = []


@pytest.fixture(autouse=True)
def _remove_the_pools_log_folders() -> Iterator[None]:
    yield
    while _LOG_FOLDERS:
        shutil.rmtree(_LOG_FOLDERS.pop(), ignore_errors=True)


def start(*args: str) -> tuple[subprocess.Popen[str], dict, str]:
    """The command, its JSON line, and its note (which names the log directories)."""
    process = subprocess.Popen(
        [*COMMAND, "--segment-size", "32MB", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stderr is not None
    line = process.stdout.readline()
    assert line, process.stderr.read()
    note = process.stderr.readline()
    folders = re.search(r"logs in (\S+) and (\S+)\.$", note.strip())
    assert folders, note
    _LOG_FOLDERS.extend(Path(folder) for folder in folders.groups())
    return process, json.loads(line), note


def master_port(config: dict) -> int:
    return int(config["kv_connector_extra_config"]["master_server_address"].rsplit(":", 1)[1])


def wait_exit(process: subprocess.Popen[str]) -> int:
    return process.wait(STARTUP_S)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_it_prints_the_transfer_config_and_stops_cleanly(stop: signal.Signals) -> None:
    process, config, note = start("--cache-prefix", "team-a", "--kv-role", "kv_consumer")
    try:
        assert config["kv_connector"] == "KVPoolConnector"
        assert config["kv_connector_module_path"] == "kvpool.connector"
        assert config["kv_role"] == "kv_consumer"
        assert config["kv_load_failure_policy"] == "recompute"
        settings = ConnectorSettings.parse(config["kv_connector_extra_config"])
        assert settings.cache_prefix == "team-a"
        assert settings.master_server_address.startswith("127.0.0.1:")
        assert port_open(master_port(config))  # it serves when the JSON appears
        assert f"master {settings.master_server_address}" in note
        started = [
            _child_named(process.pid, b"mooncake_master"),
            _child_named(process.pid, b"mooncake_client"),
        ]
        process.send_signal(stop)
        assert wait_exit(process) == 0
        assert not port_open(master_port(config))
        assert [pid for pid in started if running(pid)] == []  # its master and store are gone
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_stop_while_the_pool_starts_stops_it_and_prints_no_config() -> None:
    """SIGTERM used to wait for the start, then print the JSON of a pool about to go."""
    process = subprocess.Popen(
        [*COMMAND, "--segment-size", "32MB"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    started: dict[int, list[bytes]] = {}
    store = None
    try:
        deadline = time.monotonic() + STARTUP_S
        while store is None:
            assert process.poll() is None and time.monotonic() < deadline, "no store started"
            started = children(process.pid)
            store = next(
                (pid for pid, command in started.items() if command[0].endswith(b"mooncake_client")), None
            )
        os.kill(store, signal.SIGSTOP)  # the start now waits for the store's memory
        master = next(command for command in started.values() if command[0].endswith(b"mooncake_master"))
        metrics_port = int(next(a for a in master if a.startswith(b"--metrics_port=")).split(b"=")[1])
        if wait_for_capacity_bytes(metrics_port) > 0:
            pytest.skip("the store mounted its memory before it was paused: the start was over")
        process.send_signal(signal.SIGTERM)
        os.kill(store, signal.SIGCONT)
        out, err = process.communicate(timeout=STARTUP_S)
        assert [pid for pid in started if running(pid)] == []  # the master and the store
        assert out == ""  # no JSON for a pool that is gone
        assert process.returncode == 0, err
        assert "kvpool-local-pool: stopping" in err
    finally:
        if store is not None and running(store):
            os.kill(store, signal.SIGCONT)
        kill_leftovers(process, started)


def wait_for_capacity_bytes(metrics_port: int) -> float:
    """The store memory the master at ``metrics_port`` reports mounted, once it answers."""
    deadline = time.monotonic() + STARTUP_S
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
                text = response.read().decode()
        except OSError:
            assert time.monotonic() < deadline, "the master never answered"
            time.sleep(0.05)
            continue
        for line in text.splitlines():
            if line.startswith("master_total_capacity_bytes "):
                return float(line.split()[1])
        return 0.0


def test_a_dead_store_stops_the_pool_with_an_error() -> None:
    process, config, _ = start()
    try:
        os.kill(_child_named(process.pid, b"mooncake_client"), signal.SIGKILL)  # the store, by PID
        assert wait_exit(process) == 1
        assert "exited unexpectedly: store" in process.stderr.read()
        assert not port_open(master_port(config))  # the master was stopped with it
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_killed_command_takes_its_master_and_store_with_it() -> None:
    """SIGKILL (the OOM killer, ``timeout -s KILL``) used to leave the master and the store running
    for good, in sessions of their own: no handler of the command runs to stop them."""
    process, config, _ = start()
    parts = [_child_named(process.pid, b"mooncake_master"), _child_named(process.pid, b"mooncake_client")]
    watchdogs = [pid for pid in children(process.pid) if pid not in parts]
    try:
        process.kill()
        process.wait()
        deadline = time.monotonic() + 30
        while any(running(pid) for pid in parts + watchdogs) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in parts + watchdogs if running(pid)] == []
        assert not port_open(master_port(config))
    finally:
        for pid in parts + watchdogs:  # what the failure left, by PID
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_pool_that_does_not_start_names_its_log_folders() -> None:
    """The command keeps its logs; the master's folder used to go unnamed when the store failed."""
    below_the_check = (
        "import sys; from kvpool.connector.local import pool_command as c; c.MIN_SEGMENT = 0; "
        "sys.exit(c.main(['--segment-size', '15MB']))"  # Mooncake's store exits below 16MB
    )
    result = subprocess.run(
        [sys.executable, "-c", below_the_check], capture_output=True, text=True, timeout=120
    )
    master = re.search(r"the master's log is in (\S+)\)", result.stderr)
    store = re.search(r"the end of (\S+)/store\.log:", result.stderr)
    _LOG_FOLDERS.extend(Path(found.group(1)) for found in (master, store) if found)
    assert result.returncode == 1, result.stderr
    assert "the pool did not start" in result.stderr
    assert master and store, result.stderr
    assert Path(master.group(1), "master.log").exists() and Path(store.group(1), "store.log").exists()
    assert result.stdout == ""


def _child_named(parent: int, name: bytes) -> int:
    """The PID of ``parent``'s child whose program ends with ``name``."""
    for pid, command in children(parent).items():
        if command[0].endswith(name):
            return pid
    raise AssertionError(f"no {name.decode()} child of {parent}")


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--segment-size", "12x"], "--segment-size"),
        (["--segment-size", "512KB"], "--segment-size"),
        (["--segment-size", "15MB"], "--segment-size: at least 16MB"),  # Mooncake's store exits
        (["--rpc-port", "70000"], "--rpc-port"),
        (["--rpc-port", "23456", "--metrics-port", "23456"], "--metrics-port: not the --rpc-port"),
        (["--cache-prefix", "a/b"], "--cache-prefix"),
        (["--kv-role", "kv_sideways"], "--kv-role"),
    ],
)
def test_bad_arguments_are_refused_naming_the_option(args: list[str], option: str) -> None:
    result = subprocess.run([*COMMAND, *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert option in result.stderr
    assert result.stdout == ""  # nothing started, nothing printed


@pytest.mark.parametrize("option", ["--rpc-port", "--metrics-port"])
def test_a_port_in_use_is_refused_naming_the_option(option: str) -> None:
    """The master used to start and exit on it (or the pool waited on another server's port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([*COMMAND, option, str(port)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"{option}: {port} is in use on 127.0.0.1" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("option", ["--rpc-port", "--metrics-port"])
def test_a_port_its_last_run_closed_is_taken_again(option: str) -> None:
    """A pool stopped with clients connected leaves their closed connections on its ports a
    while (TIME_WAIT): a plain bind counts them as in use, the master's (SO_REUSEADDR) does
    not, and the pool was refused a restart on its own fixed ports."""
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        with socket.create_connection(("127.0.0.1", port)):
            accepted, _ = server.accept()
            accepted.close()  # the server closes first, as a stopped master does: TIME_WAIT
    process, _, note = start(option, str(port))
    try:
        assert f"127.0.0.1:{port}" in note
        process.send_signal(signal.SIGTERM)
        assert wait_exit(process) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tenant", "team-a"], "--tenant: 'team-a' is not NAME=QUOTA"),
        (["--tenant", "Team=1GB"], "--tenant: 'Team' is not a tenant"),
        (["--tenant", "team-a=lots"], "--tenant team-a: 'lots' is not a size"),
        (["--tenant", "team-a=0"], "--tenant team-a: a quota is at least 1 byte"),
        (["--disk-capacity", "12x"], "--disk-capacity: '12x' is not a size"),
        (["--tenant", "team-a=1GB", "--tenant", "team-a=2GB"], "--tenant team-a: given twice"),
        (["--disk-dir", "/tmp"], "--disk-dir: needs --disk-capacity"),
        (["--disk-key-limit", "10"], "--disk-key-limit: needs --disk-capacity"),
        (["--disk-eviction", "fifo"], "--disk-eviction: needs --disk-capacity"),
        (["--disk-high-watermark", "0.5"], "--disk-high-watermark: needs --disk-capacity"),
        (
            ["--disk-capacity", "1GB", "--disk-low-watermark", "0.95"],
            "--disk-low-watermark, --disk-high-watermark: 0 < low watermark < high watermark <= 1",
        ),
        (["--disk-capacity", "1GB", "--disk-dir", "/nonexistent/dir"], "--disk-dir: /nonexistent/dir is not"),
        (["--disk-capacity", "512KB"], "--disk-capacity: at least 1 MiB"),
        (["--disk-capacity", "1GB", "--disk-key-limit", "0"], "--disk-key-limit: at least 1 object"),
    ],
)
def test_bad_tenant_and_disk_options_are_refused_naming_the_option(args: list[str], message: str) -> None:
    result = subprocess.run([*COMMAND, *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == ""


def test_tenants_and_a_disk_tier(tmp_path) -> None:
    """A JSON line per tenant; the master holds their quotas; the tier's directory goes with the pool."""
    from kvpool.connector.local.tenant_quotas import read_quotas

    process, config, note = start(
        "--tenant",
        "team-a=24MB",
        "--tenant",
        "team-b=24MB",
        "--disk-capacity",
        "64MB",
        "--disk-dir",
        str(tmp_path),
    )
    try:
        assert process.stdout is not None
        second = json.loads(process.stdout.readline())
        tenants = [ConnectorSettings.parse(c["kv_connector_extra_config"]).tenant for c in (config, second)]
        assert tenants == ["team-a", "team-b"]
        metrics = note.split("(metrics http://", 1)[1].split("/metrics", 1)[0]
        assert {t: q.effective for t, q in read_quotas(metrics).items()} == {
            "team-a": 16 << 20,
            "team-b": 16 << 20,
        }
        (tier,) = tmp_path.iterdir()
        assert f"disk tier 64MB in {tier}" in note
        process.send_signal(signal.SIGTERM)
        assert wait_exit(process) == 0
        assert list(tmp_path.iterdir()) == []
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
