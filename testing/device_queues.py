"""A stand-in for an accelerator's streams and events, for tests on machines without one.

:class:`RecordedQueues` is a :class:`~kvpool.connector.integrity.device_order.DeviceQueues`
that queues nothing (the copies run at once on CPU tensors) and records, per thread, every
marker recorded, every stream made to wait for one, and every host ``synchronize``. A
marker may stand for device work not yet done (``pending``): it lands when a stream is made
to wait for it or the host synchronizes it, as a device runs queued work in order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvpool.connector.integrity.device_order import DeviceQueues


class RecordedMarker:
    """A marker; ``land``: the queued work before it, run the first time anything waits for it."""

    def __init__(self, queues: RecordedQueues, recorded_on: str, land: Callable[[], None] | None = None):
        self._queues = queues
        self.recorded_on = recorded_on
        self._land = land
        self.landed = land is None

    def run_queued_work(self) -> None:
        with self._queues.lock:
            if not self.landed and self._land is not None:
                self._land()
            self.landed = True

    def synchronize(self) -> None:
        self._queues.note("synchronize", self)
        self.run_queued_work()


class RecordedQueues(DeviceQueues):
    """Every call of the connector on the device's queues, as (what, thread name, marker)."""

    def __init__(self) -> None:
        super().__init__(device=None)
        self.lock = threading.RLock()
        self.calls: list[tuple[str, str, RecordedMarker | None]] = []
        #: Work the next markers recorded stand for (popped one per marker), e.g. a forward.
        self.pending: list[Callable[[], None]] = []
        self.transfer_threads: set[str] = set()

    def note(self, what: str, marker: RecordedMarker | None) -> None:
        with self.lock:
            self.calls.append((what, threading.current_thread().name, marker))

    def record(self) -> RecordedMarker:
        with self.lock:
            land = self.pending.pop(0) if self.pending else None
        marker = RecordedMarker(self, threading.current_thread().name, land)
        self.note("record", marker)
        return marker

    def current_stream_waits(self, marker: object) -> None:
        assert isinstance(marker, RecordedMarker)
        self.note("wait_event", marker)
        marker.run_queued_work()  # the stream runs on only after the work before the marker

    def enter_transfer_thread(self) -> None:
        with self.lock:
            self.transfer_threads.add(threading.current_thread().name)

    def on(self, thread: str, what: str) -> list[RecordedMarker | None]:
        """The markers of every ``what`` call made on ``thread``."""
        with self.lock:
            return [marker for call, name, marker in self.calls if call == what and name == thread]


class BlockingQueues(DeviceQueues):
    """A device whose stream waits are played by the waiting thread blocking on the marker.

    For CPU caches, whose copies run at once when queued: a transfer thread made to "wait"
    for a marker copies only once the marker's ``synchronize`` returned, as its stream's
    copies would run only after the event. ``make_marker`` makes each marker recorded.
    """

    def __init__(self, make_marker: Callable[[], Any]):
        super().__init__(device=None)
        self.make_marker = make_marker

    def record(self) -> Any:
        return self.make_marker()

    def current_stream_waits(self, marker: Any) -> None:
        marker.synchronize()

    def enter_transfer_thread(self) -> None:
        pass
