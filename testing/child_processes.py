"""A process's children as ``/proc`` shows them: what a command started, and whether it runs.

A command's tests take its children's PIDs while it runs and check, once it is stopped, that
none runs on (an orphan is re-parented, and keeps running; one its parent reaped is gone).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterable
from typing import Any


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


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie has exited: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_leftovers(command: subprocess.Popen[Any], pids: Iterable[int]) -> None:
    """After a command's test: kill the command if it still runs, then each of ``pids`` (its
    children) that a failed stop left running, by PID."""
    if command.poll() is None:
        command.kill()
        command.wait()
    for pid in pids:
        if running(pid):
            os.kill(pid, signal.SIGKILL)
