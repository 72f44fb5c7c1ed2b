"""Run the operator: API client, metrics endpoint and kopf, for as long as kopf runs."""

from __future__ import annotations

import asyncio
import threading
from contextlib import AsyncExitStack

import kopf
from kubernetes_asyncio.client import ApiClient

from kvpool.operator.config import OperatorConfig, make_settings
from kvpool.operator.endpoints import serve_metrics
from kvpool.operator.handlers import make_registry
from kvpool.operator.kube import USER_AGENT, Kube, load_configuration
from kvpool.operator.metrics import OperatorMetrics
from kvpool.operator.runtime import Runtime


async def run(
    config: OperatorConfig,
    *,
    stop_flag: threading.Event | asyncio.Event | None = None,
    ready_flag: threading.Event | asyncio.Event | None = None,
) -> None:
    """Run until kopf exits (a signal, or ``stop_flag`` set); see ``kopf.operator``."""
    configuration = await load_configuration(config.kubeconfig)
    metrics = OperatorMetrics()
    async with ApiClient(configuration) as api, AsyncExitStack() as stack:
        api.user_agent = USER_AGENT
        kube = Kube(api, on_write=metrics.count_write, timeout=config.request_timeout)
        runtime = Runtime(config, configuration, kube, metrics)
        if config.metrics_port is not None:
            await stack.enter_async_context(
                serve_metrics(metrics.registry, config.metrics_host, config.metrics_port)
            )
        await kopf.operator(
            registry=make_registry(runtime),
            settings=make_settings(config),
            clusterwide=not config.namespaces,
            namespaces=list(config.namespaces),
            standalone=True,
            liveness_endpoint=config.liveness_endpoint,
            stop_flag=stop_flag,
            ready_flag=ready_flag,
        )
