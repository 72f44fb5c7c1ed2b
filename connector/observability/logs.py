"""Loggers that print through vLLM's own log handlers (the ``vllm`` logger tree).

Log lines never carry prompt text, token ids or pool keys (a key names its block's token
prefix). The messages of exceptions they log are withheld, unless the connector raised them
itself: a Mooncake binding's error repeats the call's arguments, its keys among them.
"""

from __future__ import annotations

import logging
import traceback

#: The package whose own exceptions' messages are logged (it writes them: no key in any).
OWN_PACKAGE = "kvpool."


class WithoutForeignExceptionMessages(logging.Filter):
    """Writes a record's exception (and those it came from) as tracebacks and types, the
    messages of those the connector did not raise withheld (see the module)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc_info = record.exc_info
        if exc_info and exc_info[1] is not None:
            record.exc_info = None
            record.exc_text = describe_exception(exc_info[1])
        return True


def describe_exception(error: BaseException) -> str:
    """``error``'s traceback, then each exception it came from, each named by its type and, when
    the connector raised it, its message."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        kind = type(current)
        name = f"{kind.__module__}.{kind.__qualname__}"
        said = (
            str(current)
            if kind.__module__.startswith(OWN_PACKAGE)
            else "(its message withheld: it may name pool keys)"
        )
        frames = "".join(traceback.format_tb(current.__traceback__))
        parts.append(f"Traceback (most recent call last):\n{frames}{name}: {said}")
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return "\n\nwhich came from:\n\n".join(parts)


_FILTER = WithoutForeignExceptionMessages()


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger`` under ``vllm.`` so vLLM's configured handlers show it, exceptions'
    messages withheld (see the module)."""
    logger = logging.getLogger(f"vllm.{name}")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger
