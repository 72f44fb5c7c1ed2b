"""Loggers that print through vLLM's own log handlers (the ``vllm`` logger tree).

Log lines never carry prompt text, token ids or pool keys (a key names its block's token
prefix). The messages of exceptions they log are kept, with what could name a prompt
redacted: a Mooncake binding's error repeats the call's arguments, its keys among them, so
every run of 16 or more hex digits (a key's digest, whole or cut) and every run of four or
more integers (token ids) becomes ``<redacted>``.
"""

from __future__ import annotations

import logging
import re
import traceback

REDACTED = "<redacted>"
# A digest or a piece of one long enough to look up; a run of integers such as token ids.
_HEX_RUN = re.compile(r"[0-9A-Fa-f]{16,}")
_INTEGER_RUN = re.compile(r"-?\d+(?:(?:\s*,\s*|\s+)-?\d+){3,}")


def redact(text: str) -> str:
    """``text`` with every hex run of 16 digits or more and every run of four or more integers
    replaced by ``<redacted>``."""
    return _INTEGER_RUN.sub(REDACTED, _HEX_RUN.sub(REDACTED, text))


class RedactedExceptions(logging.Filter):
    """Writes a record's exception (and those it came from) as tracebacks, types and redacted
    messages (see the module)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc_info = record.exc_info
        if exc_info and exc_info[1] is not None:
            record.exc_info = None
            try:
                record.exc_text = describe_exception(exc_info[1])
            except Exception:  # a filter that raises would raise out of the logging call
                record.exc_text = _type_name(type(exc_info[1]))
        return True


def describe_exception(error: BaseException) -> str:
    """``error``'s traceback, then each exception it came from, each named by its type and its
    redacted message."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        frames = "".join(traceback.format_tb(current.__traceback__))
        parts.append(
            f"Traceback (most recent call last):\n{frames}{_type_name(type(current))}: {_message(current)}"
        )
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return "\n\nwhich came from:\n\n".join(parts)


def _type_name(kind: type[BaseException]) -> str:
    """An exception type's qualified name."""
    return f"{kind.__module__}.{kind.__qualname__}"


def _message(error: BaseException) -> str:
    """``error``'s redacted message; a placeholder where its ``__str__`` raises."""
    try:
        return redact(str(error))
    except Exception:
        return "<exception str() failed>"


_FILTER = RedactedExceptions()


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger`` under ``vllm.`` so vLLM's configured handlers show it, exceptions'
    messages redacted (see the module)."""
    logger = logging.getLogger(f"vllm.{name}")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger
