"""Byte sizes as Mooncake's config takes them: an integer, or a string such as ``"4GB"``."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

#: Mooncake takes sizes as 64-bit integers.
MAX_SIZE = 2**63 - 1
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
SIZE_RULE = "use a whole number of bytes or a string like '4GB'"


def parse_size(value: Any) -> int:
    """Bytes from an int or a string such as ``"4GB"``, ``"512 MiB"``, ``"1024"``.

    Units are binary (1 GB = 2**30 bytes), as in Mooncake's own config. A fraction is
    taken only where it makes whole bytes (``"1.5GB"``); ``"0.5"``, ``"0.3KB"`` and ``0.5``
    are refused, as are booleans.
    """
    if isinstance(value, bool):
        raise ValueError(f"{str(value).lower()} is a boolean, not a size: {SIZE_RULE}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and len(value) <= 64:
        match = _SIZE_RE.fullmatch(value)
        if match and match.group(2).lower() in _UNITS:
            size = Fraction(match.group(1)) * _UNITS[match.group(2).lower()]
            if size.denominator == 1:
                return int(size)
            raise ValueError(f"{value!r} is {float(size):g} bytes, not a whole number: {SIZE_RULE}")
    text = value[:40] if isinstance(value, str) else value
    raise ValueError(f"{text!r} is not a size: {SIZE_RULE}")
