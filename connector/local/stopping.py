"""SIGINT and SIGTERM as an exception, so that a command stops what it started.

Python's default SIGTERM ends the process at once: no ``finally`` runs, and what a command
started in sessions of their own (a Mooncake master and store) or as its children (an
engine process, the layout probe's ranks) runs on. Raised from the signal handler, the
exception unwinds the command like any error: each ``with`` and ``finally`` stops its part.

A stop that must run to its end (a pool's store, then its master) runs :func:`deferred`: a
signal arriving in it is raised once it is over, not in its middle.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_deferring = 0  # how many deferred() blocks the main thread is in
_pending: int | None = None  # a signal that arrived in one, raised when the outermost ends


class Stopped(BaseException):
    """SIGINT or SIGTERM arrived; ``exit_status`` is the shell's for a process it ended. Not an
    ``Exception``, as ``KeyboardInterrupt`` is not: the ``except Exception`` of the code it lands
    in (logging's, a library's) cannot swallow it, and with it the one stop signal raised."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    global _pending
    for other in SIGNALS:  # the stop it starts runs to its end (each step has a deadline)
        signal.signal(other, signal.SIG_IGN)
    if _deferring:
        _pending = signum
        return
    raise Stopped(signum)


@contextmanager
def raise_on_stop_signals() -> Iterator[None]:
    """In this block, SIGINT or SIGTERM raises :class:`Stopped` in the main thread, once: later
    ones are ignored, so that a second Ctrl-C cannot cut the stop short and leave a part running.
    The handlers found are back once it is over. Outside the main thread, it changes nothing."""
    if threading.current_thread() is not threading.main_thread():  # signals go to the main thread
        yield
        return
    global _pending
    found = {signum: signal.getsignal(signum) for signum in SIGNALS}
    for signum in SIGNALS:
        signal.signal(signum, _raise_stopped)
    try:
        yield
    finally:
        for signum, handler in found.items():
            signal.signal(signum, handler)
        _pending = None  # one a deferred block that failed kept: it is not raised after the block


@contextmanager
def deferred() -> Iterator[None]:
    """A block a stop signal does not cut short: :class:`Stopped` is raised once it is over (where
    it ends without an error of its own). Outside :func:`raise_on_stop_signals`, it changes nothing."""
    global _deferring, _pending
    if threading.current_thread() is not threading.main_thread():  # signals go to the main thread
        yield
        return
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
    if not _deferring and _pending is not None:
        signum, _pending = _pending, None
        raise Stopped(signum)
