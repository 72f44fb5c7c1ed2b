"""vLLM's cache reset, in the pool: remove this layout's keys, never another layout's.

vLLM calls the scheduler connector's ``reset_cache`` when it resets its prefix
cache with ``reset_connector`` (``POST /reset_prefix_cache?reset_external=true``,
``pause_generation`` with ``clear_cache``, ``LLM.reset_prefix_cache(reset_connector=True)``).
The connector then removes every object under ``<cache_prefix>/<fingerprint>/``:
the keys of this layout only (every engine of the same layout shares them),
never another prefix's or layout's.

Mooncake never removes an object a lookup or a read holds (its lease); such
objects would survive one pass. So after the first pass the removal repeats in
the background, once a second, for ``SWEEP_S`` seconds (past Mooncake's lease).
Blocks saved during that time may be removed too: a later miss, never wrong KV.
Saves already in flight when the reset comes may still land afterwards.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kvpool.connector.contract.keys import KeySpace
from kvpool.connector.observability.logs import get_logger

logger = get_logger(__name__)

SWEEP_S = 30.0
SWEEP_INTERVAL_S = 1.0


def layout_pattern(keyspace: KeySpace) -> str:
    """The regular expression of every key of ``keyspace`` (its prefix and layout), anchored."""
    # Prefixes are [A-Za-z0-9_.-] and fingerprints hex: only '.' means more than itself.
    prefix = keyspace.cache_prefix.replace(".", "\\.")
    return f"^{prefix}/{keyspace.fingerprint}/"


class LayoutReset:
    """Clears one layout's keys from the pool on vLLM's reset."""

    def __init__(self, client: Any, keyspace: KeySpace, sweep_s: float = SWEEP_S):
        self.client = client
        self.pattern = layout_pattern(keyspace)
        self.sweep_s = sweep_s
        self._lock = threading.Lock()
        self._sweep_until = 0.0
        self._sweeper: threading.Thread | None = None
        self._closed = threading.Event()

    def reset(self) -> bool:
        """Remove the layout's keys now, and keep removing held ones for ``sweep_s``; False on error."""
        try:
            removed = self.client.remove_matching(self.pattern)
        except Exception:  # the pool unreachable: vLLM reports the reset as failed
            logger.warning("KVPoolConnector reset: removing %s failed", self.pattern, exc_info=True)
            return False
        if removed < 0:
            logger.warning(
                "KVPoolConnector reset: Mooncake refused to remove %s (code %d)", self.pattern, removed
            )
            return False
        logger.info(
            "KVPoolConnector reset: removed %d object(s) matching %s; removing held ones for %.0f s",
            removed,
            self.pattern,
            self.sweep_s,
        )
        with self._lock:
            self._sweep_until = time.monotonic() + self.sweep_s
            if self._sweeper is None or not self._sweeper.is_alive():
                self._sweeper = threading.Thread(target=self._sweep, name="kvpool-reset", daemon=True)
                self._sweeper.start()
        return True

    def _sweep(self) -> None:
        while not self._closed.wait(SWEEP_INTERVAL_S):
            with self._lock:
                if time.monotonic() >= self._sweep_until:
                    self._sweeper = None
                    return
            try:
                removed = self.client.remove_matching(self.pattern)
            except Exception:  # the next pass tries again
                logger.debug("KVPoolConnector reset sweep failed", exc_info=True)
                continue
            if removed > 0:
                logger.info("KVPoolConnector reset: removed %d more object(s) of %s", removed, self.pattern)

    def close(self) -> None:
        self._closed.set()
        sweeper = self._sweeper
        if sweeper is not None:
            sweeper.join(timeout=2 * SWEEP_INTERVAL_S)
