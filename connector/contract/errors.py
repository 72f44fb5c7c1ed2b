"""How a pydantic validation error reads to a user: which field, which rule.

The connector's settings and the operator's pool spec both report their
problems through these two functions, so the wording is the same on both sides.
"""

from __future__ import annotations

from typing import Any

UNKNOWN_FIELD = "unknown field"


def field_path(loc: tuple[int | str, ...], root: str = "") -> str:
    """A field path such as ``spec.consumers[0].layout.groups[1].kind``."""
    out = root
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def error_message(error: Any, unknown: str = UNKNOWN_FIELD) -> str:
    """The user-facing message of one ``ValidationError.errors()`` entry."""
    if error["type"] == "extra_forbidden":
        return unknown
    return str(error["msg"]).removeprefix("Value error, ")
