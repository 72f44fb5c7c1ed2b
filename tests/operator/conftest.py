"""Fixtures for the operator tests: kmock as the API server, the real operator against it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import pytest_asyncio

from kvpool.operator.config import OperatorConfig, WebhookConfig
from kvpool.operator.resources import POOLS
from tests.operator.harness import (
    ApiServer,
    Cluster,
    Operator,
    OperatorThread,
    declare_resources,
    eventually,
    free_port,
    write_kubeconfig,
)


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[Cluster]:
    """A fresh emulated API server on 127.0.0.1 that knows the builtins and the CRD."""
    async with ApiServer() as api, kmock.Server(api, host="127.0.0.1"):
        declare_resources(api)
        yield Cluster(api)


@pytest.fixture
def operator_config() -> dict[str, Any]:
    """Overrides for the operator's config; parametrize to change (``webhook``: serve it)."""
    return {}


@pytest_asyncio.fixture
async def operator(
    cluster: Cluster,
    operator_config: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Operator]:
    """The real operator (kopf and all) running against ``cluster``, watching pools."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", cluster.url)
    liveness_port, metrics_port = free_port(), free_port()
    settings: dict[str, Any] = {
        "kubeconfig": str(kubeconfig),
        "liveness_endpoint": f"http://127.0.0.1:{liveness_port}/healthz",
        "metrics_host": "127.0.0.1",
        "metrics_port": metrics_port,
        "resync_interval": 0.5,
        "retry_delay": 0.3,
        "request_timeout": 10.0,
        "exit_timeout": None,
    }
    webhook_url = None
    operator_config = dict(operator_config)
    if operator_config.pop("webhook", False):
        port = free_port()
        settings["webhook"] = WebhookConfig(port=port, addr="127.0.0.1", host="127.0.0.1", insecure=True)
        webhook_url = f"http://127.0.0.1:{port}"
    settings.update(operator_config)
    thread = OperatorThread(OperatorConfig(**settings))
    thread.start()
    try:
        await eventually(
            lambda: (
                any(
                    r.action == kmock.action.WATCH
                    and r.resource is not None
                    and r.resource.plural == POOLS.plural
                    for r in cluster.requests()
                )
                or not thread.alive
            ),
            what="the operator watches pools",
        )
        assert thread.alive, f"the operator died: {thread.error!r}"
        yield Operator(
            thread, settings["liveness_endpoint"], f"http://127.0.0.1:{metrics_port}/metrics", webhook_url
        )
    finally:
        await thread.stop()
    assert thread.error is None, repr(thread.error)
    assert cluster.unauthorised() == []
