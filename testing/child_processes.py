"""A process's children as ``/proc`` shows them: what a command started, and whether it runs.

A command's tests take its children's PIDs while it runs and check, once it is stopped, that
none runs on (an orphan is re-parented, and keeps running; one its parent reaped is gone).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvpool.connector.local.process_group import (
    group_members,
    kill_group,
    remove_shared_memory,
    running,
    shared_memory_held,
)

# A killed group's end: one implementation, the product's (``kvpool-demo``, ``kvpool-layout``
# and their watchdogs end engine groups with it): the group killed, its resource trackers last,
# and the ``/dev/shm`` names it held that no live process holds removed.
__all__ = [
    "children",
    "group_members",
    "kill_group",
    "kill_leftovers",
    "python_answer",
    "remove_shared_memory",
    "running",
    "shared_memory_held",
    "wait_group_gone",
]

ROOT = Path(__file__).resolve().parents[1]


def children(parent: int) -> dict[int, list[bytes]]:
    """Each child of ``parent``: its PID and its command line."""
    found: dict[int, list[bytes]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().split(b"\0")
        except OSError:
            continue
        if ppid == parent:
            found[int(entry)] = command
    return found


def kill_leftovers(command: subprocess.Popen[Any], pids: Iterable[int]) -> None:
    """After a command's test: kill the command if it still runs, then each of ``pids`` (its
    children) that a failed stop left running, by PID."""
    if command.poll() is None:
        command.kill()
        command.wait()
    for pid in pids:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def wait_group_gone(pgid: int, timeout: float = 30.0) -> bool:
    """Whether process group ``pgid`` has no live process within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while group_members(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def python_answer(code: str, *args: str, cwd: Path = ROOT) -> Any:
    """What ``code``, run by a child interpreter in ``cwd`` with ``args``, prints last, as JSON
    (a child keeps this process free of what the code imports and configures)."""
    done = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
