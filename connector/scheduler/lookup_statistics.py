"""Per-group lookup statistics over the whole looked-up prefix, off the lookup's path.

A lookup asks the master only about the blocks its fixed point reads. Its
statistics (blocks present per group, each group's own hit) count every block a
hit could have used, so :class:`PresenceBackfill` asks about the rest on a
thread of its own, the keys of every lookup waiting for it in one call, and
computes the statistics there once answered (:meth:`Backfill.then`), off the
scheduler thread that exports them. Read earlier, a record's statistics wait
for that answer, never past the lookup deadline: then they count what the
lookup itself asked about.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence

from kvpool.connector.observability.logs import get_logger

logger = get_logger(__name__)

Clock = Callable[[], float]


class Backfill:
    """One lookup's question; :meth:`result` is its answer (None: none in time)."""

    def __init__(self, make_keys: Callable[[], list[str]], deadline: float):
        self.make_keys = make_keys
        self.deadline = deadline
        self.flags: list[bool] | None = None
        self.keys = 0
        self._done = threading.Event()
        self._then: list[Callable[[], object]] = []
        self._then_lock = threading.Lock()  # the answering thread and a late then() may race

    def then(self, follow_up: Callable[[], object]) -> None:
        """Run ``follow_up`` on the backfill's thread once answered (statistics computed
        there, not on the scheduler thread when they are exported); at once, on this
        thread, when the answer is already in."""
        with self._then_lock:
            self._then.append(follow_up)
        if self._done.is_set():  # answered before this was queued: nobody else runs it
            self.follow_up()

    def answer(self, flags: list[bool] | None) -> None:
        self.flags = flags
        self._done.set()

    def follow_up(self) -> None:
        """Run what :meth:`then` queued so far, each once."""
        with self._then_lock:
            queued, self._then = self._then, []
        for follow_up in queued:
            try:
                follow_up()
            except Exception:  # statistics only: computed again when read
                logger.debug("KVPoolConnector lookup statistics failed to compute", exc_info=True)

    def result(self, clock: Clock = time.monotonic) -> list[bool] | None:
        """Presence of each key, waiting at most until the deadline."""
        self._done.wait(max(0.0, self.deadline - clock()))
        return self.flags


class PresenceBackfill:
    """Existence checks for statistics: one thread, pending questions batched into one call.

    While a call has been in flight for longer than ``timeout_s`` (a frozen master),
    new questions get no answer at once instead of queueing behind it.
    """

    def __init__(
        self, exists: Callable[[list[str]], list[bool]], timeout_s: float, clock: Clock = time.monotonic
    ):
        self._exists = exists
        self._timeout_s = timeout_s
        self._clock = clock
        self._cond = threading.Condition()
        self._queue: list[Backfill] = []
        self._busy_since: float | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, make_keys: Callable[[], list[str]]) -> Backfill:
        """Ask about the keys ``make_keys`` builds (on the backfill's thread)."""
        handle = Backfill(make_keys, self._clock() + self._timeout_s)
        with self._cond:
            stuck = self._busy_since is not None and self._clock() - self._busy_since > self._timeout_s
            if self._closed or stuck:
                handle.answer(None)
                return handle
            self._queue.append(handle)
            if self._thread is None:
                # A daemon: a call stuck inside Mooncake never holds up the process's exit.
                self._thread = threading.Thread(target=self._run, name="kvpool-lookup-stats", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return handle

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every question so far is answered (benchmarks); False past ``timeout_s``."""
        end = self._clock() + timeout_s
        with self._cond:
            while self._queue or self._busy_since is not None:
                left = end - self._clock()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            pending, self._queue = self._queue, []
            self._cond.notify_all()
        for handle in pending:
            handle.answer(None)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batch, self._queue = self._queue, []
                self._busy_since = self._clock()
            try:
                keys: list[str] = []
                for handle in batch:
                    handle_keys = handle.make_keys()
                    handle.keys = len(handle_keys)
                    keys += handle_keys
                flags: list[bool] | None = self._exists(keys) if keys else []
            except Exception:  # statistics only: count what the lookups asked
                logger.debug("KVPoolConnector statistics' existence check failed", exc_info=True)
                flags = None
            at = 0
            for handle in batch:
                handle.answer(None if flags is None else flags[at : at + handle.keys])
                at += handle.keys
            for handle in batch:
                handle.follow_up()
            with self._cond:
                self._busy_since = None
                self._cond.notify_all()


def read_by_position(
    questions: Mapping[int, Sequence[int]], flags: list[bool], ranks: Callable[[int], int]
) -> dict[int, list[bool]]:
    """Per group, whether every rank holds each block, from flags in key order (per group,
    per rank, per block)."""
    answers: dict[int, list[bool]] = {}
    at = 0
    for group_id, indices in questions.items():
        count = len(indices)
        held = flags[at : at + count]
        for _ in range(1, ranks(group_id)):
            at += count
            held = [a and b for a, b in zip(held, flags[at : at + count])]
        at += count
        answers[group_id] = held
    return answers
