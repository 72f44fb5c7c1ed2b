"""Fixtures for the operator tests: kmock as the API server, the real operator against it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from kvpool.operator.app import OperatorOptions, WebhookOptions
from testing.kube_api import (
    Cluster,
    emulated_cluster,
    held_port,
    quick_options,
    running_operator,
    write_kubeconfig,
)
from testing.operator_objects import Operator


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[Cluster]:
    """A fresh emulated API server on 127.0.0.1 that knows the builtins and the CRD."""
    async with emulated_cluster() as cluster:
        yield cluster


@pytest.fixture
def operator_config() -> dict[str, Any]:
    """Overrides for the operator's run options; parametrize to change (``webhook``: serve it)."""
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
    overrides = dict(operator_config)
    webhook_url = None
    if overrides.pop("webhook", False):
        port = held_port()
        overrides["webhook"] = WebhookOptions(port=port, addr="127.0.0.1", host="127.0.0.1", insecure=True)
        webhook_url = f"http://127.0.0.1:{port}"
    options = OperatorOptions(
        **quick_options(write_kubeconfig(tmp_path / "kubeconfig", cluster.url), **overrides)
    )
    async with running_operator(cluster, options) as thread:
        yield Operator(
            thread,
            str(options.liveness_endpoint),
            f"http://127.0.0.1:{options.metrics_port}/metrics",
            webhook_url,
        )
