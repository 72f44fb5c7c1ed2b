"""An engine process ends with everything it forked: past its deadline, on a stop signal, and
when its starter is SIGKILLed.

The child here stands in for an engine: ``python -m`` a module that forks a grandchild (as vLLM
forks its engine core and workers), which maps a file in ``/dev/shm`` (as vLLM's message queues
do), and both hang. That ``kvpool-demo`` SIGKILLed takes its real engine with it is
``tests/connector/local/test_demo_arguments.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpool.connector.local.engine import run_module
from kvpool.connector.local.stopping import Stopped, raise_on_stop_signals
from testing.child_processes import running

MODULE = "kvpool_test_hanging_engine"
#: The hanging child: it starts a grandchild in its group, which maps a file in /dev/shm and
#: writes its PID; then the child writes its own, and both sleep.
MODULE_SOURCE = textwrap.dedent(
    """
    import json, pathlib, subprocess, sys, time

    spec = json.loads(pathlib.Path(sys.argv[1]).read_text())
    grandchild = '''
    import mmap, os, sys, time
    fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    segment = mmap.mmap(fd, 4096)
    open(sys.argv[2] + ".tmp", "w").write(str(os.getpid()))
    os.rename(sys.argv[2] + ".tmp", sys.argv[2])
    while True:
        time.sleep(60)
    '''
    subprocess.Popen([sys.executable, "-c", grandchild, spec["segment"], spec["grandchild_pid"]])
    while not pathlib.Path(spec["grandchild_pid"]).exists():
        time.sleep(0.01)
    pathlib.Path(spec["child_pid"] + ".tmp").write_text(str(__import__("os").getpid()))
    pathlib.Path(spec["child_pid"] + ".tmp").rename(spec["child_pid"])
    while True:
        time.sleep(60)
    """
)
#: How long the child has to start its grandchild before a run's deadline (it takes a second).
RUN_TIMEOUT_S = 15.0
#: How long a SIGKILLed starter's child and grandchild may take to be gone.
GONE_S = 60.0


@dataclass
class HangingEngine:
    """Where the hanging child's module, PID files and shared memory segment are."""

    folder: Path

    @property
    def spec(self) -> dict[str, str]:
        return {
            "child_pid": str(self.folder / "child.pid"),
            "grandchild_pid": str(self.folder / "grandchild.pid"),
            "segment": self.segment,
        }

    @property
    def segment(self) -> str:
        return f"/dev/shm/kvpool-test-engine-{self.folder.name}"

    @property
    def env(self) -> dict[str, str]:
        return {"PYTHONPATH": os.pathsep.join([str(self.folder), os.environ.get("PYTHONPATH", "")])}

    def pids(self) -> list[int]:
        """The child's and the grandchild's PIDs, those written yet."""
        files = (self.folder / "child.pid", self.folder / "grandchild.pid")
        return [int(path.read_text()) for path in files if path.exists()]

    def started(self) -> bool:
        return len(self.pids()) == 2


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[HangingEngine]:
    folder = tmp_path / uuid.uuid4().hex[:12]
    folder.mkdir()
    (folder / f"{MODULE}.py").write_text(MODULE_SOURCE)
    hanging = HangingEngine(folder)
    yield hanging
    for pid in hanging.pids():  # what a failed test left running, by PID
        if running(pid):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(hanging.segment)


def _until(condition: Callable[[], bool], deadline_s: float) -> bool:
    """Whether ``condition`` came true before the deadline."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def test_past_its_deadline_the_child_and_what_it_forked_are_gone(engine: HangingEngine) -> None:
    """``subprocess.run``'s timeout killed the child alone: the grandchild (an engine core, a
    worker) ran on, orphaned, with its shared memory."""
    with pytest.raises(subprocess.TimeoutExpired):
        run_module(MODULE, engine.spec, env=engine.env, timeout=RUN_TIMEOUT_S)
    assert engine.started(), "the child had not started its grandchild by the deadline"
    assert [pid for pid in engine.pids() if running(pid)] == []
    assert not os.path.exists(engine.segment)


def test_a_stop_signal_ends_the_child_and_what_it_forked(engine: HangingEngine) -> None:
    """Ctrl-C or SIGTERM of the starter (``Stopped`` here, ``KeyboardInterrupt`` elsewhere) killed
    the child alone, the grandchild ran on."""

    def stop_once_started() -> None:
        if _until(engine.started, GONE_S):
            os.kill(os.getpid(), signal.SIGTERM)

    stopper = threading.Thread(target=stop_once_started, daemon=True)
    with raise_on_stop_signals(), pytest.raises(Stopped):
        stopper.start()
        run_module(MODULE, engine.spec, env=engine.env, timeout=GONE_S * 2)
    stopper.join()
    assert engine.started()
    assert [pid for pid in engine.pids() if running(pid)] == []
    assert not os.path.exists(engine.segment)


def test_a_sigkilled_starter_takes_the_child_and_what_it_forked_with_it(engine: HangingEngine) -> None:
    """Nothing ended the child when its starter was SIGKILLed (the OOM killer, ``timeout -s KILL``):
    it and its grandchild ran on for good, with its shared memory."""
    starter_code = (
        "import json, sys\n"
        "from kvpool.connector.local.engine import run_module\n"
        "run_module(sys.argv[1], json.loads(sys.argv[2]), env=json.loads(sys.argv[3]), timeout=3600)\n"
    )
    starter = subprocess.Popen(
        [sys.executable, "-c", starter_code, MODULE, json.dumps(engine.spec), json.dumps(engine.env)]
    )
    try:
        assert _until(lambda: engine.started() or starter.poll() is not None, GONE_S)
        assert engine.started(), f"the starter exited with {starter.returncode}"
        starter.kill()
        starter.wait()
        assert _until(lambda: not any(running(pid) for pid in engine.pids()), GONE_S), "still running"
        assert _until(lambda: not os.path.exists(engine.segment), GONE_S), "its segment is left"
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
