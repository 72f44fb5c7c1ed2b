"""A Mooncake existence call that never ends, for one client: the fake of the wedge of
benchmarks/README.md, finding 9 (one ``batch_is_exist`` held ~4.5 minutes past Mooncake's RPC
timeout after a frozen store and a leader failover), which no short run reproduces on demand.

:class:`Wedge` patches ``MooncakeDistributedStore.batch_is_exist`` (a ``pytest.MonkeyPatch``
undoes it): calls on the one store object it names block until :meth:`Wedge.release` (or
``cap_s``), then go on to the real method; every other client's calls are real.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from testing.mooncake_faults import mooncake_store_class


class Wedge:
    """``batch_is_exist`` of one Mooncake store object blocks until :meth:`release`."""

    def __init__(self, store: Any, cap_s: float = 240.0):
        self.store = store
        self.cap_s = cap_s
        self.entered = 0
        self.returned = 0
        self._gate = threading.Event()
        self._lock = threading.Lock()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> Wedge:
        store_class = mooncake_store_class()
        original: Callable[..., Any] = store_class.batch_is_exist
        wedge = self

        def batch_is_exist(store: Any, keys: Any) -> Any:
            if store is not wedge.store:
                return original(store, keys)
            with wedge._lock:
                wedge.entered += 1
            try:
                wedge._gate.wait(wedge.cap_s)
                return original(store, keys)
            finally:
                with wedge._lock:
                    wedge.returned += 1

        monkeypatch.setattr(store_class, "batch_is_exist", batch_is_exist)
        return self

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self.entered - self.returned

    def release(self) -> None:
        self._gate.set()
