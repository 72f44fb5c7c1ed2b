"""Stalled Mooncake calls, injected at the client boundary (``MooncakeDistributedStore``).

:class:`Stall` patches one method of ``mooncake.store.MooncakeDistributedStore`` (every
client of this process, an engine's included): a call that names one of the chosen keys
(any key when none are chosen) blocks until :meth:`Stall.release` or for at most
``cap_s``, as a call to a frozen store or master does until Mooncake's own timeout. With
``scribble``, the stalled call then writes a byte pattern into every buffer it was given
(a read that lands late), and answers as if it had read each whole buffer. Otherwise it
goes on to the real method.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest

SCRIBBLE = 0xAB


@dataclass
class Stall:
    method: str
    keys: set[str] = field(default_factory=set)
    scribble: bool = False
    cap_s: float = 30.0
    stalled: int = 0
    returned: int = 0
    _gate: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> Stall:
        from mooncake.store import MooncakeDistributedStore

        original: Callable[..., Any] = getattr(MooncakeDistributedStore, self.method)
        stall = self

        def stalled(store: Any, keys: Any, *args: Any) -> Any:
            if not stall.matches(keys):
                return original(store, keys, *args)
            with stall._lock:
                stall.stalled += 1
            try:
                stall._gate.wait(stall.cap_s)
                if stall.scribble:
                    return _scribble(args[0], args[1])
                return original(store, keys, *args)
            finally:
                with stall._lock:
                    stall.returned += 1

        monkeypatch.setattr(MooncakeDistributedStore, self.method, stalled)
        return self

    def matches(self, keys: Iterable[str] | str) -> bool:
        names = [keys] if isinstance(keys, str) else list(keys)
        return not self.keys or any(k in self.keys for k in names)

    def release(self) -> None:
        self._gate.set()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self.stalled - self.returned


def _scribble(all_ptrs: list[list[int]], all_sizes: list[list[int]]) -> list[int]:
    codes = []
    for ptrs, sizes in zip(all_ptrs, all_sizes, strict=True):
        for ptr, size in zip(ptrs, sizes, strict=True):
            ctypes.memset(ptr, SCRIBBLE, size)
        codes.append(sum(sizes))
    return codes
