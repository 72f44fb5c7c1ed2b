"""kopf handlers: thin wrappers that hand each event to the runtime.

Built per run into their own registry, so intervals come from the config and several
operators (tests) never share handlers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import aiohttp
import kopf

from kvpool.operator import validation
from kvpool.operator.kube import ApiError, connection_info
from kvpool.operator.reconcile import Notify
from kvpool.operator.resources import POOLS
from kvpool.operator.runtime import Runtime

POOL = (POOLS.group, POOLS.version, POOLS.plural)
VALIDATE_ID = "validate-pool"
RETRYABLE = (ApiError, aiohttp.ClientError, asyncio.TimeoutError)


def notifier(body: Mapping[str, Any]) -> Notify:
    """Post Kubernetes Events about the pool ``body``."""

    def notify(type_: str, reason: str, message: str) -> None:
        kopf.event(dict(body), type=type_, reason=reason, message=message)

    return notify


def admission_problems(body: Mapping[str, Any]) -> str | None:
    """The webhook's verdict: a message naming every field and rule, or None when valid."""
    meta = body.get("metadata") or {}
    name = meta.get("name") or meta.get("generateName") or "pool"
    _, _, problems = validation.validate(name, meta.get("namespace") or "default", body.get("spec"))
    return validation.describe(problems) if problems else None


def spec_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether an UPDATE changes the spec of a pool that is not being deleted."""
    if (new.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return old is None or old.get("spec") != new.get("spec")


def make_registry(runtime: Runtime) -> kopf.OperatorRegistry:
    """All handlers of one operator run."""
    registry = kopf.OperatorRegistry()
    config = runtime.config
    retry = {"errors": kopf.ErrorsMode.TEMPORARY, "backoff": config.retry_delay}

    async def run(trigger: str, body: Mapping[str, Any]) -> None:
        try:
            await runtime.reconcile(body, trigger, notifier(body))
        except RETRYABLE as exc:
            raise kopf.TemporaryError(f"{trigger}: {exc}", delay=config.retry_delay) from exc

    @kopf.on.login(registry=registry)
    async def login(**_: Any) -> kopf.ConnectionInfo:
        return await connection_info(runtime.configuration)

    @kopf.on.resume(*POOL, registry=registry, id="resume", **retry)
    async def resume(body: kopf.Body, **_: Any) -> None:
        await run("resume", body)

    @kopf.on.create(*POOL, registry=registry, id="create", **retry)
    async def create(body: kopf.Body, **_: Any) -> None:
        await run("create", body)

    @kopf.on.update(*POOL, registry=registry, id="update", field="spec", **retry)
    async def update(body: kopf.Body, **_: Any) -> None:
        await run("update", body)

    @kopf.timer(
        *POOL,
        registry=registry,
        id="resync",
        interval=config.resync_interval,
        initial_delay=config.resync_interval,
        **retry,
    )
    async def resync(body: kopf.Body, **_: Any) -> None:
        await run("resync", body)

    @kopf.on.delete(*POOL, registry=registry, id="teardown", **retry)
    async def delete(body: kopf.Body, **_: Any) -> None:
        try:
            await runtime.teardown(body, notifier(body))
        except RETRYABLE as exc:
            raise kopf.TemporaryError(f"delete: {exc}", delay=config.retry_delay) from exc

    if config.webhook is not None:  # kopf refuses admission handlers without a server

        @kopf.on.validate(*POOL, registry=registry, id=VALIDATE_ID, operations=["CREATE", "UPDATE"])
        def validate(body: kopf.Body, old: Any = None, operation: str | None = None, **_: Any) -> None:
            if operation == "UPDATE" and not spec_changed(old, body):
                return  # metadata/status updates (e.g. a finalizer's removal) never block
            message = admission_problems(body)
            if message:
                raise kopf.AdmissionError(message, code=422)

    @kopf.on.probe(registry=registry, id="pools")
    def pools(**_: Any) -> int:
        return len(runtime.metrics.conditions)

    return registry
