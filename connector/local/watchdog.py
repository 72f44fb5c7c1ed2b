"""A watchdog per started process: it SIGKILLs the process once the process that started it is gone.

A Mooncake master or store runs in a session of its own, so it outlives its starter: SIGINT and
SIGTERM stop it through the command's handlers, but a SIGKILL (the OOM killer, ``timeout -s
KILL``, a cancelled CI job) left it running for good, holding its ports and memory. Linux's
``PR_SET_PDEATHSIG`` fires when the *thread* that started a child exits, and pools are started
from other threads too (tests, benchmarks); so a small process watches instead. It holds the
read end of a pipe whose write end only the starter holds (the kernel closes it however the
starter ends) and a pidfd of the watched process: at end of file it SIGKILLs the watched
process's group if the process still runs (the process alone if it leads no group), then
removes the ``/dev/shm`` files they held (:mod:`~kvpool.connector.local.process_group`); it
exits on its own once the watched process exits (the pidfd names that process only: a PID
reused meanwhile is never signalled). An engine runs under one too, in a group of its own
(:mod:`~kvpool.connector.local.supervised`), with the processes vLLM forks.

The watching half runs as this file, with the standard library and its sibling
``process_group.py`` only: ``python watchdog.py FD PID``.
"""

from __future__ import annotations

import importlib
import os
import select
import signal
import subprocess
import sys
import threading
from typing import Any, Protocol

RELEASE_S = 10.0


class Started(Protocol):
    """A started process (a ``subprocess.Popen``, a ``multiprocessing.Process``)."""

    @property
    def pid(self) -> int | None: ...


class Watchdog:
    """A watchdog process for ``pid``, in a session of its own (a terminal's Ctrl-C is not its)."""

    def __init__(self, pid: int) -> None:
        read_end, self._write_end = os.pipe()  # neither is inherited by other children
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", __file__, str(read_end), str(pid)],
                stdin=subprocess.DEVNULL,
                pass_fds=(read_end,),
                start_new_session=True,
            )
        except BaseException:
            os.close(self._write_end)
            raise
        finally:
            os.close(read_end)

    def release(self, timeout: float = RELEASE_S) -> None:
        """Close the pipe (the watchdog SIGKILLs the process if it still runs) and reap the watchdog."""
        if self._write_end >= 0:
            os.close(self._write_end)
            self._write_end = -1
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_watchdogs: dict[int, Watchdog] = {}  # PID of a watched process -> its watchdog
_lock = threading.Lock()


def watch(process: Started) -> None:
    """Start a watchdog for ``process`` (kept until :func:`release`)."""
    if process.pid is None:
        raise ValueError("process: not started (no PID to watch)")
    dog = Watchdog(process.pid)
    with _lock:
        stale = _watchdogs.pop(process.pid, None)  # of a process reaped elsewhere: its PID is reused
        _watchdogs[process.pid] = dog
    if stale is not None:
        stale.release()


def release(process: Started) -> None:
    """Release ``process``'s watchdog, if it has one; call it once the process is reaped."""
    if process.pid is None:
        return
    with _lock:
        dog = _watchdogs.pop(process.pid, None)
    if dog is not None:
        dog.release()


def _watch(fd: int, pid: int, group: Any) -> None:
    """Until the pipe's end of file (the starter is gone: SIGKILL ``pid``'s group, or ``pid`` alone
    if it leads none, and remove their shared memory) or ``pid``'s exit. ``group`` is the module
    :mod:`~kvpool.connector.local.process_group`."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.register(pidfd, select.POLLIN)
    while True:
        ready = {ready_fd for ready_fd, _ in poller.poll()}
        if pidfd in ready:
            return  # it exited
        if fd in ready and not os.read(fd, 1):
            break
    try:
        signal.pidfd_send_signal(pidfd, 0)  # still the same process: its PID (and group) is its own
        if os.getpgid(pid) == pid:
            group.end_group(pid, grace_s=0)
            return
        held = group.shared_memory_held([pid])
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        return
    select.select([pidfd], [], [], group.GONE_TIMEOUT_S)  # readable once it has exited
    group.remove_shared_memory(held)


if __name__ == "__main__":
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # -I leaves the file's folder out
    _watch(int(sys.argv[1]), int(sys.argv[2]), importlib.import_module("process_group"))
