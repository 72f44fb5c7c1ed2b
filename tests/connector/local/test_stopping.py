"""SIGINT and SIGTERM unwind a command once: a second signal cannot cut its stop short, nor the
first one a stop that must run to its end (a real Mooncake pool's)."""

from __future__ import annotations

import io
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable

import pytest

from kvpool.connector.local.pool import LocalPool
from kvpool.connector.local.stopping import SIGNALS, Stopped, deferred, raise_on_stop_signals


def test_the_first_signal_raises_and_later_ones_are_ignored() -> None:
    found = {signum: signal.getsignal(signum) for signum in SIGNALS}
    with raise_on_stop_signals():
        with pytest.raises(Stopped) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
        assert stopped.value.exit_status == 128 + signal.SIGTERM
        assert str(stopped.value) == "SIGTERM"
        # The stop now runs (each step with a deadline): a second Ctrl-C or SIGTERM changes nothing.
        assert all(signal.getsignal(signum) == signal.SIG_IGN for signum in SIGNALS)
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
    assert {signum: signal.getsignal(signum) for signum in SIGNALS} == found  # the caller's again


def test_a_signal_in_a_deferred_block_is_raised_once_it_is_over() -> None:
    done = []
    with raise_on_stop_signals(), pytest.raises(Stopped) as stopped, deferred():
        os.kill(os.getpid(), signal.SIGINT)
        done.append("the rest of the block")
    assert done == ["the rest of the block"]
    assert stopped.value.exit_status == 128 + signal.SIGINT


def test_a_signal_a_failed_deferred_block_kept_goes_with_the_handlers() -> None:
    """It was raised by the next deferred block, in whatever came after (a later pool's stop)."""
    with raise_on_stop_signals(), pytest.raises(ValueError), deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        raise ValueError("the block's own error")
    with deferred():
        pass


def test_a_signal_landing_in_an_except_exception_still_stops() -> None:
    """Stopped was an ``Exception``: logging's handler (as any ``except Exception``) swallowed it,
    and with later signals ignored, nothing stopped the command any more."""

    class Stream(io.StringIO):
        def write(self, text: str) -> int:
            os.kill(os.getpid(), signal.SIGTERM)  # lands in the handler's emit
            return super().write(text)

    logger = logging.getLogger("kvpool.test.stopping")
    handler = logging.StreamHandler(Stream())
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with raise_on_stop_signals(), pytest.raises(Stopped):
            logger.warning("a record")
    finally:
        logger.removeHandler(handler)


def _pending_signals(pid: int) -> int:
    """The signals sent to ``pid`` and not yet handled (a stopped process handles none)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1], 16) for line in f if line.startswith("ShdPnd:"))


def _until(condition: Callable[[], bool], deadline_s: float = 60.0) -> bool:
    """Whether ``condition`` came true before the deadline."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.mooncake
def test_a_signal_while_a_pool_stops_its_store_still_stops_its_master() -> None:
    """The signal landed in the store's stop and unwound the pool's: its master, in a session of
    its own, ran on with nobody to stop it."""
    pool = LocalPool(segment_size="32MB").start()
    assert pool.master is not None and pool.store is not None
    master, store = pool.master.process, pool.store.process
    assert master is not None and store is not None
    failures: list[str] = []

    def signal_while_the_store_stops() -> None:
        told = _until(lambda: bool(_pending_signals(store.pid) & (1 << (signal.SIGTERM - 1))))
        ours = signal.getsignal(signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        handled = _until(lambda: signal.getsignal(signal.SIGTERM) != ours)  # it ran
        os.kill(store.pid, signal.SIGCONT)  # now it stops
        failures.extend(what for what, ok in (("told", told), ("handled", handled)) if not ok)

    os.kill(store.pid, signal.SIGSTOP)  # its stop waits for it while the signal lands
    helper = threading.Thread(target=signal_while_the_store_stops)
    helper.start()
    try:
        with raise_on_stop_signals(), pytest.raises(Stopped):
            pool.stop()
        helper.join()
        assert failures == []
        assert master.poll() is not None  # stopped, as the store was
        assert store.poll() is not None
    finally:
        helper.join()
        for process in (store, master):  # what a failed stop left, by PID
            if process.poll() is None:
                process.kill()
                process.wait()
        for part in (pool.master, pool.store):
            shutil.rmtree(part.log_dir, ignore_errors=True)
