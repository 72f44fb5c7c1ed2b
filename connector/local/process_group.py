"""A process group's end: its processes stopped, and the ``/dev/shm`` files they held removed.

A child started in a session of its own (an engine and what it forks: vLLM's engine core, its
tensor-parallel workers) is a process group; :func:`end_group` ends all of it, as a SIGKILL of
the child alone does not. A process killed before it unlinks its POSIX shared memory (vLLM's
message queues, ``multiprocessing``'s semaphores) leaves the names in ``/dev/shm``; vLLM's
resource tracker unlinks them when it outlives their owners, and what it could not unlink,
:func:`remove_shared_memory` does: only files the group held and no live process holds.

Standard library only: the watchdog (:mod:`~kvpool.connector.local.watchdog`), run as a file,
loads it as its sibling.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable

#: Where POSIX shared memory (``shm_open``) lives on Linux.
SHARED_MEMORY = "/dev/shm"
#: How long a group has between SIGTERM and SIGKILL (vLLM shuts its workers down in it).
TERM_GRACE_S = 5.0
#: How long a SIGKILLed group may take to be gone.
GONE_TIMEOUT_S = 30.0
POLL_S = 0.05


def _stat_fields(pid: int | str) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie has exited: it runs nothing)."""
    try:
        return _stat_fields(pid)[0] != "Z"
    except OSError:
        return False


def group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = _stat_fields(entry)
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def shared_memory_held(pids: Iterable[int]) -> set[tuple[int, int]]:
    """The files in ``/dev/shm`` that ``pids`` map or hold open, as (device, inode): the very files,
    not whatever takes their names later (a semaphore is mapped under a name since unlinked)."""
    held: set[tuple[int, int]] = set()
    prefix = SHARED_MEMORY + "/"
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(prefix):
                    major, minor = (int(part, 16) for part in fields[3].split(":"))
                    held.add((os.makedev(major, minor), int(fields[4])))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                        st = os.stat(f"/proc/{pid}/fd/{fd}")
                        held.add((st.st_dev, st.st_ino))
    return held


def remove_shared_memory(held: set[tuple[int, int]]) -> list[str]:
    """Unlink each name in ``/dev/shm`` whose file is one of ``held`` (:func:`shared_memory_held`)
    and that no live process maps or holds open; the paths removed. Call it once the processes
    that held them are gone."""
    if not held:
        return []
    live = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    in_use = shared_memory_held(pid for pid in live if running(pid))
    removed = []
    for name in os.listdir(SHARED_MEMORY):
        path = os.path.join(SHARED_MEMORY, name)
        with contextlib.suppress(OSError):
            st = os.stat(path, follow_symlinks=False)
            identity = (st.st_dev, st.st_ino)
            if identity in held and identity not in in_use:
                os.unlink(path)
                removed.append(path)
    return removed


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


#: What a ``multiprocessing`` resource tracker runs (``python -c``). Its processes register the
#: names they create with it (a spawned child uses its parent's); once none of them is left (end
#: of file on its pipe) it unlinks those they did not, and ends. It ignores SIGTERM.
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
    """SIGKILL process group ``pgid``, its resource trackers last; what its processes held in
    ``/dev/shm`` just before (for :func:`remove_shared_memory` once the group is gone).

    A tracker killed with the rest would leave the names it keeps: those of a process killed
    earlier (vLLM's shutdown SIGKILLs a worker that lingers), which nothing maps any more. So
    the group is stopped, every other member is killed, and the trackers, continued, unlink
    those names and end (within ``tracker_grace`` seconds, else they are killed too)."""
    _signal_group(pgid, signal.SIGSTOP)  # nothing starts, maps or forks meanwhile
    members = group_members(pgid)
    held = shared_memory_held(members)
    trackers = [pid for pid in members if is_resource_tracker(pid)]
    for pid in members:
        if pid not in trackers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    _signal_group(pgid, signal.SIGCONT)
    deadline = time.monotonic() + tracker_grace
    while any(running(pid) for pid in trackers) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    _signal_group(pgid, signal.SIGKILL)
    return held


def _wait_gone(pgid: int, timeout: float, held: set[tuple[int, int]]) -> bool:
    """Until group ``pgid`` has no live process (adding what it holds to ``held``); whether it is gone."""
    deadline = time.monotonic() + timeout
    while members := group_members(pgid):
        held |= shared_memory_held(members)
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def end_group(pgid: int, grace_s: float = TERM_GRACE_S, timeout_s: float = GONE_TIMEOUT_S) -> bool:
    """SIGTERM process group ``pgid``, SIGKILL what is left of it after ``grace_s`` (at once for 0;
    its resource trackers last, :func:`kill_group`),
    wait until none of it runs (at most ``timeout_s``), then remove the ``/dev/shm`` files it held
    that no live process holds. Whether it is gone.

    Call it while the group's leader is not yet reaped (running, or a zombie): a group ID can
    only be taken by a new process once all of its group is gone."""
    held = shared_memory_held(group_members(pgid))
    gone = False
    if grace_s > 0:
        _signal_group(pgid, signal.SIGTERM)
        gone = _wait_gone(pgid, grace_s, held)
    if not gone:
        held |= kill_group(pgid)
        gone = _wait_gone(pgid, timeout_s, held)
    remove_shared_memory(held)
    return gone
