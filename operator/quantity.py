"""Kubernetes resource quantities (``"8Gi"``, ``"500M"``, ``"1e9"``) as numbers."""

from __future__ import annotations

import re
from decimal import Decimal, DecimalException

_SUFFIXES: dict[str, Decimal] = {
    "": Decimal(1),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}
MAX_QUANTITY = Decimal(2**63)
_QUANTITY_RE = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)([a-zA-Z]*)$")


def parse_quantity(value: int | float | str) -> Decimal:
    """The numeric value of a Kubernetes quantity; ``ValueError`` if it is not one."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a quantity")
    if isinstance(value, int | float):
        number = Decimal(str(value))
    else:
        match = _QUANTITY_RE.match(value.strip())
        if not match or match.group(2) not in _SUFFIXES:
            raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. '8Gi', '500M')")
        try:
            number = Decimal(match.group(1)) * _SUFFIXES[match.group(2)]
        except DecimalException:
            raise ValueError(f"{value!r} is not a Kubernetes quantity") from None
    if not number.is_finite() or abs(number) >= MAX_QUANTITY:
        raise ValueError(f"{value!r} is beyond any resource quantity (at most 2**63-1)")
    return number


def format_bytes(size: int) -> str:
    """A byte count as the shortest exact binary quantity (``"4Gi"``, ``"1536Mi"``)."""
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = int(_SUFFIXES[suffix])
        if size and size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)
