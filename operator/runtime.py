"""The running operator's state and the bodies of its handlers.

Each pass is serialised per pool (change handlers and the resync timer may overlap),
reads a fresh copy of the pool, and writes the status only when it changed.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Mapping
from typing import Any

from kubernetes_asyncio.client import Configuration

from kvpool.operator.config import OperatorConfig
from kvpool.operator.kube import ApiError, Kube
from kvpool.operator.metrics import OperatorMetrics
from kvpool.operator.patching import diff
from kvpool.operator.reconcile import Notify, reconcile, teardown
from kvpool.operator.resources import POOLS
from kvpool.operator.status import condition_of


def utcnow() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def error_reason(exc: BaseException) -> str:
    """A short label for the metrics: ``http_409``, ``TimeoutError``, ..."""
    if isinstance(exc, ApiError):
        return f"http_{exc.status}"
    return type(exc).__name__


def announce(old: Mapping[str, Any], new: Mapping[str, Any], notify: Notify) -> None:
    """Post an Event when the spec turns invalid (or its problems change), or valid again."""
    before = condition_of(old, "ConfigValid") or {}
    after = condition_of(new, "ConfigValid") or {}
    if after.get("status") == "False":
        if before.get("status") != "False" or before.get("message") != after.get("message"):
            notify("Warning", after.get("reason", "InvalidSpec"), after.get("message", ""))
    elif after.get("status") == "True" and before.get("status") == "False":
        notify("Normal", "ConfigValid", after.get("message", ""))


class Runtime:
    """Client, metrics and per-pool locks of one running operator."""

    def __init__(
        self, config: OperatorConfig, configuration: Configuration, kube: Kube, metrics: OperatorMetrics
    ):
        self.config = config
        self.configuration = configuration
        self.kube = kube
        self.metrics = metrics
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    def _lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    async def reconcile(self, body: Mapping[str, Any], trigger: str, notify: Notify) -> dict[str, Any] | None:
        """One pass over the pool ``body`` names; its status, or None if it is gone."""
        meta = body.get("metadata", {})
        namespace, name = meta["namespace"], meta["name"]
        async with self._lock(namespace, name):
            with self.metrics.duration.labels(trigger).time():
                try:
                    pool = await self.kube.get(POOLS, namespace, name)
                    if pool is None or pool.get("metadata", {}).get("deletionTimestamp"):
                        return None
                    result = await reconcile(self.kube, pool, now=utcnow(), notify=notify)
                    old = pool.get("status") or {}
                    if result.status != old:
                        await self.kube.patch(
                            POOLS, namespace, name, {"status": diff(old, result.status)}, subresource="status"
                        )
                        announce(old, result.status, notify)
                except Exception as exc:
                    self.metrics.reconciles.labels(trigger, "error").inc()
                    self.metrics.errors.labels(trigger, error_reason(exc)).inc()
                    raise
            outcome = "success" if result.plan.valid else "invalid"
            self.metrics.reconciles.labels(trigger, outcome).inc()
            self.metrics.observe_pool(namespace, name, result.status)
            return result.status

    async def teardown(self, body: Mapping[str, Any], notify: Notify) -> None:
        """Release consumers and delete children of a pool being deleted."""
        meta = body.get("metadata", {})
        namespace, name = meta["namespace"], meta["name"]
        async with self._lock(namespace, name):
            try:
                await teardown(self.kube, body, notify)
            except Exception as exc:
                self.metrics.reconciles.labels("delete", "error").inc()
                self.metrics.errors.labels("delete", error_reason(exc)).inc()
                raise
            self.metrics.reconciles.labels("delete", "success").inc()
            self.metrics.forget_pool(namespace, name)
            self._locks.pop((namespace, name), None)
