"""SIGINT and SIGTERM unwind a command once: a second signal cannot cut its stop short."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from kvpool.connector.local.stopping import SIGNALS, Stopped, raise_on_stop_signals


@pytest.fixture
def _handlers_restored() -> Iterator[None]:
    saved = {signum: signal.getsignal(signum) for signum in SIGNALS}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.mark.usefixtures("_handlers_restored")
def test_the_first_signal_raises_and_later_ones_are_ignored() -> None:
    raise_on_stop_signals()
    with pytest.raises(Stopped) as stopped:
        os.kill(os.getpid(), signal.SIGTERM)
    assert stopped.value.exit_status == 128 + signal.SIGTERM
    assert str(stopped.value) == "SIGTERM"
    # The stop now runs (each step with a deadline): a second Ctrl-C or SIGTERM changes nothing.
    assert all(signal.getsignal(signum) == signal.SIG_IGN for signum in SIGNALS)
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGTERM)
