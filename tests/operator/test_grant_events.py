"""A grant's own event on the emulated API, while a pass over its pool waits to begin.

A pass reads only the grants its pool takes, and sweeps the unlisted ones once per spec
generation: a grant from another namespace that arrives while a pass is queued must still
be told at once that the pool does not list its namespace. The operator's own grant handler
(``grant_changed``) runs here with a reconciler of the test's, so that the queued pass is
certain, not a race; its client sends the library's own user agent, so the chart's RBAC
recorder does not count these requests as the operator's (the handler's GET and status
PATCH are among the operator's recorded scenarios).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from kubernetes_asyncio.client import ApiClient

from kvpool.operator.app import grant_changed
from kvpool.operator.kube import KubeClient, load_configuration
from kvpool.operator.metrics import OperatorMetrics
from kvpool.operator.reconcile import Reconciler
from testing.kube_api import (
    GRANTS_PATH,
    NAMESPACE,
    TENANT_NAMESPACE,
    UNSERVED_MASTER_HEALTH_URL,
    Cluster,
    write_kubeconfig,
)
from testing.operator_objects import pool_manifest, vllm_deployment
from tests.operator.test_grants_on_the_api import grant_manifest, tenancy_spec

pytestmark = pytest.mark.asyncio


@contextlib.asynccontextmanager
async def reconciler_of(cluster: Cluster, tmp_path: Path) -> AsyncIterator[Reconciler]:
    configuration = await load_configuration(str(write_kubeconfig(tmp_path / "kubeconfig", cluster.url)))
    async with ApiClient(configuration) as api:
        yield Reconciler(KubeClient(api, timeout=10.0), OperatorMetrics(), None, UNSERVED_MASTER_HEALTH_URL)


async def test_an_unlisted_grant_is_refused_while_a_pass_over_its_pool_waits(
    cluster: Cluster, tmp_path: Path
) -> None:
    await cluster.create(vllm_deployment())
    await cluster.create(grant_manifest("team-a", "24MB"))
    pool = await cluster.create(pool_manifest(spec=tenancy_spec("team-a")))
    async with reconciler_of(cluster, tmp_path) as reconciler:
        # A whole pass first: it sweeps this spec's unlisted grants (none yet), and no later
        # pass of the same spec sweeps again, so only the grant's own handler can refuse it.
        await asyncio.wait_for(reconciler.reconcile(pool, "test", lambda *_: None), 120)
        unlisted = await cluster.create(
            grant_manifest("llm", "24MB", namespace=TENANT_NAMESPACE, pool_namespace=NAMESPACE)
        )
        # One pass runs (its first request in flight), a second waits for it to end.
        running = asyncio.create_task(reconciler.reconcile(pool, "test", lambda *_: None, coalesce=True))
        await asyncio.sleep(0)
        waiting = asyncio.create_task(reconciler.reconcile(pool, "test", lambda *_: None, coalesce=True))
        await asyncio.sleep(0)
        try:
            assert reconciler.queued(NAMESPACE, "pool")
            await grant_changed(reconciler, unlisted, "ADDED")
            await asyncio.wait_for(asyncio.gather(running, waiting), 120)
            # Told by its handler, not left to the waiting pass (which reads only listed namespaces).
            grant = cluster.get(GRANTS_PATH, "llm", TENANT_NAMESPACE)
            conditions = (grant or {}).get("status", {}).get("conditions") or []
            assert [(c["type"], c["status"], c["reason"]) for c in conditions] == [
                ("Accepted", "False", "NamespaceNotAllowed")
            ]
        finally:
            for task in (running, waiting):
                task.cancel()
            await asyncio.gather(running, waiting, return_exceptions=True)
