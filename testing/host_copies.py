"""A fault in the connector's host copies, for tests of the checks made after a copy."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from typing import Any

import pytest


@contextlib.contextmanager
def torn_copies() -> Iterator[None]:
    """Inside, every ``ctypes.memmove`` flips one bit of what it wrote (a torn write): the
    destination then differs from its source, which stays intact."""
    real_move = ctypes.memmove

    def torn_move(dst: int, src: int, count: int) -> Any:
        moved = real_move(dst, src, count)
        ctypes.c_ubyte.from_address(dst).value ^= 0x01
        return moved

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ctypes, "memmove", torn_move)
        yield
