"""``kvpool-demo`` refuses bad arguments before it builds or starts anything, and a stop
signal stops what it started.

The demo itself (a pool and three real engines) runs as the README's quick start; here its
refusals, which must come before the model is built, the pool started or an engine run, and
SIGTERM while its first engine starts.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpool.connector.local import demo
from kvpool.connector.local.engine import ENGINE_MODULE
from testing.child_processes import children, kill_leftovers, running

#: How long the demo may take to build its model, start its pool and its first engine.
STARTUP_S = 120.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefix-len", "-5"], "--prefix-len: at least 32"),
        (["--prefix-len", "0"], "--prefix-len: at least 32"),
        (["--prefix-len", "31"], "--prefix-len: at least 32"),
        (["--max-tokens", "0"], "--max-tokens: at least 1"),
        (["--prefix-len", "1000"], "--prefix-len: at most 962 with --max-tokens 12"),
        (["--prefix-len", "900", "--max-tokens", "100"], "--prefix-len: at most 874 with --max-tokens 100"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = tmp_path / "model"
    with pytest.raises(SystemExit) as exited:
        demo.main(["--model-dir", str(model_dir), *args])
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert message in err
    assert out == ""  # nothing ran: no "model:" line, no pool
    assert not model_dir.exists()


def test_the_longest_prefix_allowed_is_accepted() -> None:
    demo._check(argparse.ArgumentParser(), argparse.Namespace(prefix_len=962, max_tokens=12))


def test_a_model_dir_that_cannot_be_made_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    assert demo.main(["--model-dir", str(blocker / "model")]) == 1
    # Its stop signals' handlers went with it: they raised in the caller (here pytest) ever after,
    # and once one had, ignored every later Ctrl-C and SIGTERM.
    assert {signum: signal.getsignal(signum) for signum in handlers} == handlers
    out, err = capsys.readouterr()
    assert f"kvpool-demo: --model-dir {blocker / 'model'}: cannot build the model there" in err
    assert "pool:" not in out  # no pool was started


def _start_demo(tmp_path: Path, stderr: int) -> subprocess.Popen[str]:
    """``kvpool-demo`` on a model it builds under ``tmp_path``, its stdout piped."""
    command = [sys.executable, "-m", "kvpool.connector.local.demo", "--model-dir", str(tmp_path / "model")]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)


def _wait_for_its_engine(process: subprocess.Popen[str], started: dict[int, list[bytes]]) -> None:
    """Until the demo's first engine process runs (the pool serves by then); its children (the
    engine, the master, the store) are in ``started`` meanwhile, for a failed wait's clean-up."""
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("  reference:"):  # the pool serves; the first engine starts
            break
    engine = ENGINE_MODULE.encode()
    deadline = time.monotonic() + STARTUP_S
    while not any(engine in command for command in started.values()):
        assert process.poll() is None and time.monotonic() < deadline, "no engine process started"
        time.sleep(0.05)
        started.clear()
        started.update(children(process.pid))


@pytest.mark.mooncake
def test_sigterm_stops_the_engine_and_the_pool(tmp_path: Path) -> None:
    """Python's default SIGTERM ended the demo alone: its engine ran on, and its master and
    store (sessions of their own) kept serving with nobody to stop them."""
    process = _start_demo(tmp_path, stderr=subprocess.PIPE)
    started: dict[int, list[bytes]] = {}
    try:
        assert process.stderr is not None
        _wait_for_its_engine(process, started)
        programs = [command[0].rsplit(b"/", 1)[-1] for command in started.values()]
        assert b"mooncake_master" in programs and b"mooncake_client" in programs
        process.send_signal(signal.SIGTERM)
        status = process.wait(STARTUP_S)
        assert [pid for pid in started if running(pid)] == []  # the engine, the master, the store
        assert status == 128 + signal.SIGTERM
        assert "kvpool-demo: stopped by SIGTERM" in process.stderr.read()
    finally:
        kill_leftovers(process, started)


@pytest.mark.mooncake
def test_sigkill_takes_the_engine_and_the_pool_with_it(tmp_path: Path) -> None:
    """A SIGKILLed demo (the OOM killer, ``timeout -s KILL``) took its master and store with it
    (their watchdogs), but its engine ran on, orphaned. The engine is stopped (SIGSTOP) first:
    it stands for one that does not end on its own, as a hung engine does not."""
    process = _start_demo(tmp_path, stderr=subprocess.DEVNULL)
    started: dict[int, list[bytes]] = {}
    try:
        _wait_for_its_engine(process, started)
        engine = ENGINE_MODULE.encode()
        (engine_pid,) = [pid for pid, command in started.items() if engine in command]
        os.kill(engine_pid, signal.SIGSTOP)
        process.kill()
        process.wait()
        deadline = time.monotonic() + STARTUP_S
        while left := [pid for pid in started if running(pid)]:
            assert time.monotonic() < deadline, f"still running: {left} of {list(started)}"
            time.sleep(0.05)
    finally:
        kill_leftovers(process, started)
