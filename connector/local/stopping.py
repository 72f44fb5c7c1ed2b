"""SIGINT and SIGTERM as an exception, so that a command stops what it started.

Python's default SIGTERM ends the process at once: no ``finally`` runs, and what a command
started in sessions of their own (a Mooncake master and store) or as its children (an
engine process, the layout probe's ranks) runs on. Raised from the signal handler, the
exception unwinds the command like any error: each ``with`` and ``finally`` stops its part.
"""

from __future__ import annotations

import signal
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(Exception):
    """SIGINT or SIGTERM arrived; ``exit_status`` is the shell's for a process it ended."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    for other in SIGNALS:  # the stop it starts runs to its end (each step has a deadline)
        signal.signal(other, signal.SIG_IGN)
    raise Stopped(signum)


def raise_on_stop_signals() -> None:
    """From now on, SIGINT or SIGTERM raises :class:`Stopped` in the main thread, once: later
    ones are ignored, so that a second Ctrl-C cannot cut the stop short and leave a part running."""
    for signum in SIGNALS:
        signal.signal(signum, _raise_stopped)
