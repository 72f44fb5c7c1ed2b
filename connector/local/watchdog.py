"""A watchdog per started process: it SIGKILLs the process once the process that started it is gone.

A Mooncake master or store runs in a session of its own, so it outlives its starter: SIGINT and
SIGTERM stop it through the command's handlers, but a SIGKILL (the OOM killer, ``timeout -s
KILL``, a cancelled CI job) left it running for good, holding its ports and memory. Linux's
``PR_SET_PDEATHSIG`` fires when the *thread* that started a child exits, and pools are started
from other threads too (tests, benchmarks); so a small process watches instead. It holds the
read end of a pipe whose write end only the starter holds (the kernel closes it however the
starter ends) and a pidfd of the watched process: at end of file it SIGKILLs the watched
process's group if the process still runs; it exits on its own once the watched process exits
(the pidfd names that process only: a PID reused meanwhile is never signalled).

The watching half runs as this file, with the standard library only: ``python watchdog.py FD PID``.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading

RELEASE_S = 10.0


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


def watch(process: subprocess.Popen[bytes]) -> None:
    """Start a watchdog for ``process`` (kept until :func:`release`)."""
    dog = Watchdog(process.pid)
    with _lock:
        stale = _watchdogs.pop(process.pid, None)  # of a process reaped elsewhere: its PID is reused
        _watchdogs[process.pid] = dog
    if stale is not None:
        stale.release()


def release(process: subprocess.Popen[bytes]) -> None:
    """Release ``process``'s watchdog, if it has one; call it once the process is reaped."""
    with _lock:
        dog = _watchdogs.pop(process.pid, None)
    if dog is not None:
        dog.release()


def _watch(fd: int, pid: int) -> None:
    """Until the pipe's end of file (the starter is gone: SIGKILL ``pid``'s group) or ``pid``'s exit."""
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
            os.killpg(pid, signal.SIGKILL)
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    _watch(int(sys.argv[1]), int(sys.argv[2]))
