"""Loggers that print through vLLM's own log handlers (the ``vllm`` logger tree)."""

from __future__ import annotations

import logging


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger`` under ``vllm.`` so vLLM's configured handlers show it.

    Log lines never carry prompt text or token ids.
    """
    return logging.getLogger(f"vllm.{name}")
