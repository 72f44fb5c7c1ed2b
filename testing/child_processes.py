"""A process's children as ``/proc`` shows them: what a command started, and whether it runs.

A command's tests take its children's PIDs while it runs and check, once it is stopped, that
none runs on (an orphan is re-parented, and keeps running; one its parent reaped is gone).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

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


#: Where Python's ``multiprocessing`` keeps what it names: ``SharedMemory`` segments
#: (``psm_*``, vLLM's message queues between an engine and its workers) and named semaphores
#: (``sem.mp-*``). Their owners unlink them when they end cleanly; a SIGKILLed owner leaves
#: them to its ``resource_tracker`` (in the same process group), which a SIGKILL of the
#: whole group stops before it unlinks them (:func:`kill_group` kills it last).
SHM_FOLDER = "/dev/shm"
SHM_PREFIXES = ("psm_", "sem.mp-")


def group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def shared_memory_held(pids: Iterable[int]) -> set[tuple[int, int]]:
    """The files in ``/dev/shm`` that ``pids`` map or hold open, as (device, inode): the very
    files, not whatever takes their names later. A semaphore's creator maps it under a
    temporary name it has unlinked since (glibc links the file to its name when it is
    ready): the inode is what names it."""
    held: set[tuple[int, int]] = set()
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(SHM_FOLDER + "/"):
                    major, minor = (int(part, 16) for part in fields[3].split(":"))
                    held.add((os.makedev(major, minor), int(fields[4])))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(SHM_FOLDER + "/"):
                        st = os.stat(f"/proc/{pid}/fd/{fd}")
                        held.add((st.st_dev, st.st_ino))
    return held


def remove_shared_memory(held: set[tuple[int, int]]) -> list[str]:
    """Unlink each name of :data:`SHM_PREFIXES` in ``/dev/shm`` whose file is one of ``held``
    (:func:`shared_memory_held`) and that no live process maps or holds open; the paths
    removed. Call it once the processes that held them are gone."""
    if not held:
        return []
    live = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    in_use = shared_memory_held(pid for pid in live if running(pid))
    removed = []
    for name in os.listdir(SHM_FOLDER):
        if not name.startswith(SHM_PREFIXES):
            continue
        path = os.path.join(SHM_FOLDER, name)
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(path, follow_symlinks=False)
            identity = (st.st_dev, st.st_ino)
            if identity in held and identity not in in_use:
                os.unlink(path)
                removed.append(path)
    return removed


#: What a ``multiprocessing`` resource tracker runs (``python -c``). Its processes register
#: the names they create with it (a spawned child uses its parent's); once none of them is
#: left (end of file on its pipe) it unlinks those they did not, and ends.
RESOURCE_TRACKER = b"from multiprocessing.resource_tracker import main"
#: How long a killed group's resource trackers get to unlink what the group left, and end.
TRACKER_GRACE_S = 10.0


def is_resource_tracker(pid: int) -> bool:
    """Whether ``pid`` runs a ``multiprocessing`` resource tracker."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return RESOURCE_TRACKER in f.read()
    except OSError:
        return False


def kill_group(pgid: int, tracker_grace: float = TRACKER_GRACE_S) -> set[tuple[int, int]]:
    """SIGKILL process group ``pgid``, its resource trackers last; what its processes held
    in ``/dev/shm`` just before (for :func:`remove_shared_memory` once the group is gone).

    A tracker killed with the rest would leave the names it keeps: those of a process killed
    earlier (vLLM's shutdown SIGKILLs a worker that lingers), which nothing maps any more. So
    the group is stopped, every other member is killed, and the trackers, continued, unlink
    those names and end (within ``tracker_grace`` seconds, else they are killed too)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGSTOP)  # nothing starts, maps or forks meanwhile
    members = group_members(pgid)
    held = shared_memory_held(members)
    trackers = [pid for pid in members if is_resource_tracker(pid)]
    for pid in members:
        if pid not in trackers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGCONT)
    deadline = time.monotonic() + tracker_grace
    while any(running(pid) for pid in trackers) and time.monotonic() < deadline:
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    return held


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
