"""A child that ends with its whole process group, however it or its starter ends.

An engine process forks vLLM's engine core and tensor-parallel workers: killing the child alone
(``subprocess.run``'s timeout, a Ctrl-C of its starter) left them running, holding memory and
``/dev/shm`` segments. :func:`run_in_own_group` starts the child in a session (so a process
group) of its own under a watchdog (:mod:`~kvpool.connector.local.watchdog`: a SIGKILLed
starter takes the group with it) and, once the child exits, its deadline passes or the starter
stops waiting (a stop signal's :class:`~kvpool.connector.local.stopping.Stopped`, an error),
ends the whole group (:func:`~kvpool.connector.local.process_group.end_group`) before it reaps it.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
from collections.abc import Mapping, Sequence
from typing import IO

from kvpool.connector.local.process_group import GONE_TIMEOUT_S, TERM_GRACE_S, end_group
from kvpool.connector.local.stopping import deferred
from kvpool.connector.local.watchdog import release, watch


def _exited_within(pid: int, timeout: float) -> bool:
    """Whether ``pid`` (a child) exits within ``timeout`` seconds; it is not reaped (a zombie keeps
    its PID, and so its group's ID, from a new process)."""
    pidfd = os.pidfd_open(pid)
    try:
        readable, _, _ = select.select([pidfd], [], [], max(timeout, 0.0))
        return bool(readable)
    finally:
        os.close(pidfd)


def run_in_own_group(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stdout: IO[bytes] | None = None,
    timeout: float,
    grace_s: float = TERM_GRACE_S,
) -> int:
    """Run ``command`` in a process group of its own (stderr with stdout) and return its exit status.

    Whatever it left running in its group is ended when it exits. Past ``timeout`` seconds its group is
    ended (SIGTERM, SIGKILL after ``grace_s``) and :class:`subprocess.TimeoutExpired` raised; an
    exception here while it runs ends the group too, then propagates.
    """
    process = subprocess.Popen(
        list(command),
        env=None if env is None else dict(env),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    exited = False
    try:
        watch(process)
        exited = _exited_within(process.pid, timeout)
    finally:
        with deferred():  # a stop signal meanwhile is raised once the group is gone
            end_group(process.pid, grace_s)  # at once where nothing is left of it
            with contextlib.suppress(subprocess.TimeoutExpired):  # then its watchdog kills it
                process.wait(GONE_TIMEOUT_S)
            release(process)
    if not exited:
        raise subprocess.TimeoutExpired(list(command), timeout)
    return process.returncode
