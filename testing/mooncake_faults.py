"""Mooncake faults injected at the client boundary (``mooncake.store.MooncakeDistributedStore``).

Each fault patches one method of the class itself, so every client of this process (an
engine's included) meets it, and a ``pytest.MonkeyPatch`` undoes it:

* :class:`Stall`: a call that names one of the chosen keys (any key when none are chosen)
  blocks until :meth:`Stall.release` or for at most ``cap_s``, as a call to a frozen store or
  master does until Mooncake's own timeout. With ``scribble``, the stalled call then writes a
  byte pattern into every buffer it was given (a read that lands late) and answers as if it
  had read each whole buffer; otherwise it goes on to the real method.
* :class:`FailingReads`: reads of the chosen keys answer a chosen code and write no byte;
  every other key goes to the real store in the same call. :func:`digests_of` picks the keys
  of a prompt's blocks.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvpool.connector.contract.keys import hash_digest
from kvpool.connector.pool_client import CODE_TRANSFER_FAILED
from testing.prompts import block_hashes

#: The byte a scribbling :class:`Stall` writes into every buffer it was given.
SCRIBBLE = 0xAB
#: The store method that reads objects into the connector's buffers.
READ_METHOD = "batch_get_into_multi_buffers"


def mooncake_store_class() -> Any:
    """Mooncake's client class, whose methods the faults here patch."""
    from mooncake.store import MooncakeDistributedStore

    return MooncakeDistributedStore


@dataclass
class Stall:
    """Calls of ``method`` naming one of ``keys`` (any key when empty) block until released."""

    method: str
    keys: set[str] = field(default_factory=set)
    scribble: bool = False
    cap_s: float = 30.0
    stalled: int = 0
    returned: int = 0
    _gate: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> Stall:
        store_class = mooncake_store_class()
        original: Callable[..., Any] = getattr(store_class, self.method)
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

        monkeypatch.setattr(store_class, self.method, stalled)
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


def digests_of(prompt: list[int], blocks: Iterable[int]) -> set[str]:
    """Key digests of ``prompt``'s blocks ``blocks`` (every group and rank uses them)."""
    hashes = block_hashes(prompt)
    return {hash_digest(hashes[i]) for i in blocks}


def key_digest(key: str) -> str:
    """The block digest a store key ends with."""
    return key.rsplit("/", 1)[-1]


@dataclass
class FailingReads:
    """Reads of keys whose digest is in ``digests`` answer ``code`` without writing."""

    digests: set[str]
    code: int = CODE_TRANSFER_FAILED
    failed: list[str] = field(default_factory=list)

    def doomed(self, key: str) -> bool:
        return key_digest(key) in self.digests

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FailingReads:
        store_class = mooncake_store_class()
        original: Callable[..., list[int]] = getattr(store_class, READ_METHOD)
        fault = self

        def read(store: Any, keys: list[str], ptrs: list[Any], sizes: list[Any], *rest: Any) -> list[int]:
            codes = [fault.code] * len(keys)
            passed = [i for i, key in enumerate(keys) if not fault.doomed(key)]
            fault.failed.extend(key for key in keys if fault.doomed(key))
            if passed:
                real = original(
                    store,
                    [keys[i] for i in passed],
                    [ptrs[i] for i in passed],
                    [sizes[i] for i in passed],
                    *rest,
                )
                for i, code in zip(passed, real, strict=True):
                    codes[i] = code
            return codes

        monkeypatch.setattr(store_class, READ_METHOD, read)
        return self
