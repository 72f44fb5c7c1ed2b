"""Count what crosses from a torch device to the host: bytes, and where the host waits.

:class:`HostBytes` patches every ``torch.Tensor`` method that hands a tensor's bytes to the
host (``cpu``, ``to`` a device, ``numpy``, ``tolist``, ``item``, ``__array__`` and the
Python number conversions) and counts the bytes of each call. On CPU tensors none of them
moves anything, but each is where an accelerator's data would cross, so a data path forced
onto CPU tensors counts what it would copy to the host.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest
import torch

CROSSINGS = ("cpu", "numpy", "tolist", "item", "__array__", "__int__", "__float__", "__bool__", "__index__")


class HostBytes:
    """Bytes handed to the host per method, while installed (thread-safe: transfer threads count)."""

    def __init__(self, thread_prefix: str = "") -> None:
        """``thread_prefix``: count only calls made on threads whose name starts with it
        (``kvpool-``: the connector's transfer threads, not an engine's own reads)."""
        self.thread_prefix = thread_prefix
        self.by_method: Counter[str] = Counter()
        self._lock = threading.Lock()

    @property
    def total(self) -> int:
        return sum(self.by_method.values())

    def reset(self) -> None:
        with self._lock:
            self.by_method.clear()

    def _count(self, method: str, tensor: torch.Tensor) -> None:
        if not threading.current_thread().name.startswith(self.thread_prefix):
            return
        with self._lock:
            self.by_method[method] += tensor.numel() * tensor.element_size()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> HostBytes:
        for method in CROSSINGS:
            original = getattr(torch.Tensor, method)

            def counted(
                tensor: torch.Tensor, *args: Any, _original: Any = original, _method: str = method, **kw: Any
            ) -> Any:
                self._count(_method, tensor)
                return _original(tensor, *args, **kw)

            monkeypatch.setattr(torch.Tensor, method, counted)
        to = torch.Tensor.to

        def counted_to(tensor: torch.Tensor, *args: Any, **kw: Any) -> Any:
            if "device" in kw or any(isinstance(a, str | torch.device) for a in args):
                self._count("to", tensor)
            return to(tensor, *args, **kw)

        monkeypatch.setattr(torch.Tensor, "to", counted_to)
        return self
