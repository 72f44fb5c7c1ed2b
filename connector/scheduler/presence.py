"""The scheduler's one thread that asks the pool which keys it holds: lookups first, statistics after.

Every existence check of the scheduler side goes through :class:`PresenceService`, on
one thread of its own (a daemon: a call stuck in Mooncake never holds up the
process's exit):

* **Lookups.** The lookups vLLM asks for during a ``schedule()`` are queued
  (:meth:`PresenceService.queue`) and handed to the thread together when the step's
  scheduling ends (:meth:`PresenceService.flush`, from ``build_connector_meta``); the
  thread answers them with one check per round across them
  (:func:`~kvpool.connector.scheduler.lookups.answer_together`). The scheduler polls
  each request's :class:`PendingLookup` once a step; nobody blocks on one.
* **Statistics.** Questions about the blocks a lookup did not ask about
  (:meth:`PresenceService.ask`) wait until no lookup does; those waiting then go out
  in one check.

**Deadlines.** A lookup's deadline is its query's, a question's ``timeout_s`` after it
was asked; a check's deadline is the earliest of those it answers, and an answer past
it is a failure (``timeout``), as is a check that would start past it. Nobody waits
past a deadline: the scheduler takes a lookup unanswered at its deadline as a miss,
:meth:`Question.result` answers None. A check still in flight past its deadline is
*stuck* (a frozen master; Mooncake's own RPC timeout ends it later): until it
returns, lookups flushed and questions asked are refused at once (a miss, no
answer) instead of queueing behind it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.connector.observability.logs import get_logger
from kvpool.connector.pool_client import Outcome
from kvpool.connector.scheduler.lookups import Lookup, answer_together

logger = get_logger(__name__)

Clock = Callable[[], float]
TIMEOUT = Outcome.TIMEOUT.value


class PendingLookup:
    """A queued lookup: :attr:`outcome` is set, then :attr:`answered`, once the thread is
    done with it (an outcome of None: it failed or was refused, a miss)."""

    __slots__ = ("answered", "cancelled", "deferred_steps", "lookup", "outcome")

    def __init__(self, lookup: Lookup):
        self.lookup = lookup
        self.outcome: Any = None
        self.answered = False
        self.cancelled = False  # its request no longer wants it: dropped unanswered
        self.deferred_steps = 0  # scheduler steps its request skipped waiting for the answer

    def cancel(self) -> None:
        self.cancelled = True


class Question:
    """Keys to ask about for statistics, built on the service's thread; :meth:`result` is
    the answer (None: none by the deadline)."""

    def __init__(self, make_keys: Callable[[], list[str]], deadline: float, clock: Clock):
        self.make_keys = make_keys
        self.deadline = deadline
        self.flags: list[bool] | None = None
        self.keys = 0
        self._clock = clock
        self._done = threading.Event()
        self._then: list[Callable[[], object]] = []
        self._then_lock = threading.Lock()  # the answering thread and a late then() may race

    @property
    def done(self) -> bool:
        """Whether the question has its answer (or its refusal)."""
        return self._done.is_set()

    def then(self, follow_up: Callable[[], object]) -> None:
        """Run ``follow_up`` on the service's thread once answered (statistics computed there,
        not on the scheduler thread that exports them); at once, on this thread, when the
        answer is already in."""
        with self._then_lock:
            self._then.append(follow_up)
        if self._done.is_set():  # answered before this was queued: nobody else runs it
            self._follow_up()

    def result(self) -> list[bool] | None:
        """Presence of each key, waiting at most until the deadline."""
        self._done.wait(max(0.0, self.deadline - self._clock()))
        return self.flags

    def _answer(self, flags: list[bool] | None) -> None:
        self.flags = flags
        self._done.set()

    def _follow_up(self) -> None:
        """Run what :meth:`then` queued so far, each once."""
        with self._then_lock:
            queued, self._then = self._then, []
        for follow_up in queued:
            try:
                follow_up()
            except Exception:  # statistics only: computed again when read
                logger.debug("KVPoolConnector lookup statistics failed to compute", exc_info=True)


class PresenceService:
    """Existence checks on one thread, each with a deadline; see the module docstring.

    ``exists(keys)`` asks the pool (bound late: a connector out of the pool has a client
    with no calls at all): the presence of each key, or that and why the pool could not
    tell (a failure reason, None when it told; then the check fails as if past its
    deadline, with that reason); ``conclude(lookup)`` turns an answered lookup into the outcome
    the scheduler takes, on this service's thread; ``timeout_s`` bounds statistics.
    """

    def __init__(
        self,
        exists: Callable[[list[str]], list[bool] | tuple[list[bool], str | None]],
        conclude: Callable[[Lookup], Any],
        timeout_s: float,
        *,
        name: str = "kvpool-presence",
        clock: Clock = time.perf_counter,
    ):
        self._exists = exists
        self._conclude = conclude
        self._timeout_s = timeout_s
        self._name = name
        self._clock = clock
        self._cond = threading.Condition()
        self._queued: list[PendingLookup] = []  # this step's, until flush
        self._sent: list[PendingLookup] = []  # flushed, for the thread
        self._questions: list[Question] = []
        self._serving: str | None = None  # "lookups" or "statistics" while the thread works
        self._call_deadline: float | None = None  # of the check in flight
        self._refused_stuck: float | None = None  # the stuck check's deadline, once warned
        self._thread: threading.Thread | None = None
        self._closed = False

    # --- lookups (the scheduler thread) ------------------------------------------------------
    def queue(self, lookup: Lookup) -> PendingLookup:
        """Hold ``lookup`` until the next :meth:`flush`."""
        pending = PendingLookup(lookup)
        with self._cond:
            self._queued.append(pending)
        return pending

    def flush(self) -> None:
        """Hand the queued lookups to the thread; refuse them at once while a check is stuck."""
        if not self._queued:  # most steps queue none (queue and flush share the scheduler thread)
            return
        with self._cond:
            if self._closed:
                refused, self._queued = self._queued, []
            else:
                self._sent += self._queued
                self._queued = []
                refused = self._refuse_lookups_if_stuck()
                if not refused:
                    self._start()
                    self._cond.notify_all()
        for pending in refused:
            pending.answered = True

    def wait_answered(self, pending: PendingLookup, timeout_s: float) -> bool:
        """Until the thread is done with ``pending`` (answered or refused); False past ``timeout_s``."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while not pending.answered:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _refuse_lookups_if_stuck(self) -> list[PendingLookup]:
        """Every sent lookup, taken back, while a check is stuck (holding the lock)."""
        deadline = self._call_deadline
        if deadline is None or self._clock() <= deadline:
            return []
        if self._refused_stuck != deadline:
            self._refused_stuck = deadline
            logger.warning(
                "KVPoolConnector existence check in flight past its deadline: lookups miss until it returns"
            )
        refused, self._sent = self._sent, []
        return refused

    # --- statistics (any thread) -----------------------------------------------------------
    def ask(self, make_keys: Callable[[], list[str]]) -> Question:
        """Ask about the keys ``make_keys`` builds (on this service's thread), after the lookups."""
        question = Question(make_keys, self._clock() + self._timeout_s, self._clock)
        with self._cond:
            if self._closed or self.stuck:
                question._answer(None)
                return question
            self._questions.append(question)
            self._start()
            self._cond.notify_all()
        return question

    @property
    def cpu_seconds(self) -> float:
        """CPU time its thread has used so far (0 before it starts): what its lookups and
        statistics cost the process beyond the scheduler's hooks."""
        thread = self._thread
        if thread is None or thread.ident is None or not thread.is_alive():
            return 0.0
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))

    # --- waiting and closing --------------------------------------------------------------
    @property
    def stuck(self) -> bool:
        """Whether a check is in flight past its deadline."""
        deadline = self._call_deadline
        return deadline is not None and self._clock() > deadline

    def wait_idle(self, timeout_s: float, *, lookups_only: bool = False) -> bool:
        """Until every lookup flushed so far (``lookups_only``), or everything asked so far, is
        answered; False past ``timeout_s``."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while (
                self._sent
                or self._serving == "lookups"
                or (not lookups_only and (self._questions or self._serving is not None))
            ):
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Refuse what is left, then wait for the check in flight until its deadline at most
        (not at all when it is stuck), so the pool's client closes after it."""
        with self._cond:
            self._closed = True
            lookups, self._queued, self._sent = self._queued + self._sent, [], []
            questions, self._questions = self._questions, []
            self._cond.notify_all()
        for pending in lookups:
            pending.answered = True
        for question in questions:
            question._answer(None)
        with self._cond:
            while (deadline := self._call_deadline) is not None and (left := deadline - self._clock()) > 0:
                self._cond.wait(left)

    # --- the thread ---------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            lookups: list[PendingLookup] = []
            questions: list[Question] = []
            with self._cond:
                while not self._sent and not self._questions and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                if self._sent:  # lookups first
                    lookups = [p for p in self._sent if not p.cancelled]
                    self._sent = []
                    self._serving = "lookups"
                else:
                    questions, self._questions = self._questions, []
                    self._serving = "statistics"
            try:
                if questions:
                    self._answer_questions(questions)
                else:
                    self._answer_lookups(lookups)
            finally:
                with self._cond:
                    self._serving = None
                    self._cond.notify_all()

    def _answer_lookups(self, batch: Sequence[PendingLookup]) -> None:
        try:
            answer_together([p.lookup for p in batch], self._check)
            for pending in batch:
                if not pending.cancelled:
                    pending.outcome = self._conclude(pending.lookup)
        except Exception:  # a lookup must never stop a request: those left are misses
            logger.exception("KVPoolConnector batched lookup failed; its requests miss")
        finally:
            for pending in batch:
                pending.answered = True

    def _answer_questions(self, batch: Sequence[Question]) -> None:
        flags: list[bool] | None
        try:
            keys: list[str] = []
            for question in batch:
                question_keys = question.make_keys()
                question.keys = len(question_keys)
                keys += question_keys
            flags, failure = self._check(keys, min(question.deadline for question in batch))
            if failure:
                flags = None
        except Exception:  # statistics only: count what the lookups asked
            logger.debug("KVPoolConnector statistics' existence check failed", exc_info=True)
            flags = None
        at = 0
        for question in batch:
            question._answer(None if flags is None else flags[at : at + question.keys])
            at += question.keys
        for question in batch:
            question._follow_up()

    def _check(self, keys: list[str], deadline: float) -> tuple[list[bool], str | None]:
        """Presence of ``keys`` by ``deadline``; past it every key is absent (``timeout``)."""
        if not keys:
            return [], None
        if self._clock() >= deadline:
            return [False] * len(keys), TIMEOUT
        with self._cond:
            self._call_deadline = deadline
        try:
            answer = self._exists(keys)
        finally:
            with self._cond:
                self._call_deadline = None
                self._cond.notify_all()
        flags, failure = answer if isinstance(answer, tuple) else (answer, None)
        if self._clock() > deadline:
            logger.warning(
                "KVPoolConnector existence check of %d keys answered past its deadline: a miss", len(keys)
            )
            return [False] * len(keys), TIMEOUT
        if failure is not None:  # the pool could not tell about some keys: a miss, counted
            return [False] * len(keys), failure
        return flags, None
