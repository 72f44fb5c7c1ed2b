"""Deadlines of the connector's transfers: who may still touch vLLM's blocks, and until when.

A :class:`Job` is one request's load or save on a transfer thread. It owns no
block while a Mooncake call is in flight (calls move bytes only through the
thread's staging buffer); it touches vLLM's blocks only between
:meth:`Job.begin_touch` and :meth:`Job.end_touch`, local copies that never wait
for the pool. Whoever waits for a job (the forward for a synchronous load, the
next step for an asynchronous one, the save barrier, shutdown) gives it a
deadline: ``timeout_s`` without progress (a batch finished). Past it, the waiter
:meth:`Job.abandon` s the job, which waits only for a copy in progress, and from
then on the job touches no block and publishes nothing. A call still stuck in
Mooncake returns later (Mooncake's own timeouts bound it) into a buffer nobody
else uses.

The :class:`JobBoard` knows the jobs that are abandoned but not yet returned:
while there are any, the pool is stalled and new transfers fail at once
instead of queueing behind them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from enum import Enum
from typing import Any

from kvpool.connector.contract.settings import ConnectorSettings

Clock = Any  # a callable returning monotonic seconds

# An idle engine step (no forward) waits this long at most for the pool work in flight
# (a step's lookups, asynchronous loads): without it the engine's loop spins holding the
# GIL and starves the threads doing that work (benchmarks/README.md, finding 7).
# The default of the ``idle_step_wait_s`` setting.
IDLE_STEP_WAIT_S: float = ConnectorSettings.model_fields["idle_step_wait_s"].default


class JobState(Enum):
    RUNNING = "running"  # queued, or in a Mooncake call: touches no block
    TOUCHING = "touching"  # copying between its staging buffer and vLLM's blocks
    DONE = "done"
    ABANDONED = "abandoned"


class Job:
    """One load or save with a progress deadline; see the module docstring."""

    def __init__(self, kind: str, timeout_s: float, clock: Clock = time.monotonic):
        self.kind = kind  # "load" or "save"
        self.timeout_s = timeout_s
        self._clock = clock
        self._cond = threading.Condition()
        self._state = JobState.RUNNING
        self._last_progress = self.started = clock()
        self._returned = False
        self.blocks_released = False  # a save: it has read every block it will read
        self.copied: set[tuple[int, int]] = set()  # a load: (group, block) it has filled so far
        self.result: Any = None

    # --- the job's side ----------------------------------------------------------
    def progress(self) -> None:
        """A batch finished: the deadline moves on."""
        with self._cond:
            self._last_progress = self._clock()

    def begin_touch(self) -> bool:
        """About to copy between the staging buffer and vLLM's blocks; False once abandoned."""
        with self._cond:
            if self._state is not JobState.RUNNING:
                return False
            self._state = JobState.TOUCHING
            return True

    def end_touch(self, *, last: bool = False) -> None:
        """The copy is done; ``last``: the job will touch no block again."""
        with self._cond:
            if self._state is JobState.TOUCHING:
                self._state = JobState.RUNNING
            if last:
                self.blocks_released = True
            self._last_progress = self._clock()
            self._cond.notify_all()

    def may_publish(self) -> bool:
        """Whether the job may still make something visible (not abandoned)."""
        with self._cond:
            return self._state is JobState.RUNNING

    def finish(self, result: Any) -> bool:
        """The job's outcome; False when it was abandoned (then the waiter reported it).

        Called in ``TOUCHING`` (after :meth:`begin_touch`), the job's bookkeeping
        before it is done cannot race a waiter that gives up on it.
        """
        with self._cond:
            if self._state is JobState.ABANDONED:
                return False
            self._state = JobState.DONE
            self.result = result
            self.blocks_released = True
            self._cond.notify_all()
            return True

    def returned(self) -> None:
        """The job's function has returned: no call of its is in flight any more."""
        with self._cond:
            self._returned = True
            self.blocks_released = True
            self._cond.notify_all()

    # --- the waiter's side --------------------------------------------------------
    @property
    def state(self) -> JobState:
        with self._cond:
            return self._state

    @property
    def done(self) -> bool:
        return self.state is JobState.DONE

    @property
    def abandoned(self) -> bool:
        return self.state is JobState.ABANDONED

    @property
    def stuck(self) -> bool:
        """Abandoned while a call of its may still be in flight."""
        with self._cond:
            return self._state is JobState.ABANDONED and not self._returned

    @property
    def in_flight(self) -> bool:
        """Whether a call of the job may still be in flight: it has neither finished (its last
        call returned before it did) nor returned since it was given up on."""
        with self._cond:
            return self._state is not JobState.DONE and not self._returned

    def age(self) -> float:
        """Seconds since the job was created (its request asked for), on the job's clock."""
        return self._clock() - self.started

    def overdue(self) -> bool:
        with self._cond:
            return self._overdue_locked()

    def _overdue_locked(self) -> bool:
        return self._state is JobState.RUNNING and self._clock() - self._last_progress > self.timeout_s

    def abandon(self) -> bool:
        """Give up on the job: True if abandoned now, False if it had finished or was given up.

        Waits only while the job copies (no pool involved); afterwards it
        touches no block and publishes nothing.
        """
        with self._cond:
            while self._state is JobState.TOUCHING:
                self._cond.wait()
            if self._state is JobState.DONE or self._state is JobState.ABANDONED:
                return False
            self._state = JobState.ABANDONED
            self._cond.notify_all()
            return True

    def wait(self, *, until_released: bool = False, deadline: float | None = None) -> bool:
        """Until done (or, ``until_released``, until it reads no more blocks); False when overdue.

        Overdue: ``timeout_s`` after the job's last progress, or past ``deadline``
        (on the job's clock) when one is given. A copy in progress is waited for.
        """
        with self._cond:
            while True:
                if self._state is JobState.DONE or self._state is JobState.ABANDONED:
                    return self._state is JobState.DONE
                if until_released and self.blocks_released:
                    return True
                now = self._clock()
                until = self._last_progress + self.timeout_s if deadline is None else deadline
                if self._state is JobState.RUNNING and now >= until:
                    return False
                self._cond.wait(max(until - now, 0.001) if self._state is JobState.RUNNING else None)


class JobBoard:
    """The live jobs of one worker; stalled while an abandoned job has not returned."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: set[Job] = set()

    def add(self, job: Job) -> None:
        with self._lock:
            self._jobs.add(job)

    def remove(self, job: Job) -> None:
        with self._lock:
            self._jobs.discard(job)

    def live(self) -> list[Job]:
        with self._lock:
            return list(self._jobs)

    @property
    def stalled(self) -> bool:
        """Whether a call the connector gave up on may still be stuck in the pool."""
        return any(job.stuck for job in self.live())

    def abandon_overdue(self, jobs: Iterable[Job] | None = None) -> list[Job]:
        """Abandon every overdue job (of ``jobs``, default all); the ones abandoned now."""
        out = []
        for job in self.live() if jobs is None else jobs:
            if job.overdue() and job.abandon():
                out.append(job)
        return out
