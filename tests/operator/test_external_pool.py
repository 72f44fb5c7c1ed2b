"""External pools on the emulated API: the operator runs nothing for them, takes away what the
pool ran before, and rolls consumers onto the named master. (Observing a real external master:
``test_real_mooncake.py``.)"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvpool.operator import names
from kvpool.operator.metric_names import POOL_INFO
from kvpool.operator.names import NETWORK_POLICIES, SERVICES
from testing.kube_api import DEPLOYMENTS_PATH, NAMESPACE, TENANT_NAMESPACE, Cluster, eventually
from testing.operator_objects import Operator, converge, kv_flags, pool_manifest, pool_spec, vllm_deployment

pytestmark = pytest.mark.asyncio

ADDRESS = "mooncake-master.platform.svc:50051"
NETPOLS_PATH = f"{NETWORK_POLICIES.api_version}/{NETWORK_POLICIES.plural}"
SERVICES_PATH = f"{SERVICES.api_version}/{SERVICES.plural}"


def external_spec() -> dict[str, Any]:
    spec = pool_spec(external={"masterServerAddress": ADDRESS})
    del spec["image"], spec["store"]
    return spec


async def test_a_pool_turned_external_stops_what_it_ran_and_rolls_its_consumer(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest())
    await converge(cluster, generation=1)
    assert cluster.get(DEPLOYMENTS_PATH, "pool-master") is not None

    await cluster.patch_pool("pool", {"spec": {**external_spec(), "image": None, "store": None}})
    status = await converge(cluster, generation=2)
    for path, name in [
        (DEPLOYMENTS_PATH, "pool-master"),
        (DEPLOYMENTS_PATH, "pool-store"),
        (SERVICES_PATH, "pool-master"),
        (NETPOLS_PATH, "pool-kvpool"),
        (NETPOLS_PATH, "pool-consumers"),
    ]:
        await eventually(lambda p=path, n=name: cluster.get(p, n) is None, what=f"{path} {name} removed")
    (flag,) = kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm"))
    assert json.loads(flag.split("=", 1)[1])["kv_connector_extra_config"]["master_server_address"] == ADDRESS
    assert status["masterAddress"] == ADDRESS
    reasons = {c["type"]: c["reason"] for c in status["conditions"]}
    assert reasons["MasterReady"] == "External" and reasons["Observed"] == "NotAsked"
    assert any("external-network" in w for w in status["warnings"])
    # The alerts on master targets leave an external pool alone: the operator says it is one.
    async with aiohttp.ClientSession() as session, session.get(operator.metrics_url) as response:
        text = await response.text()
    info = POOL_INFO.exported
    assert f'{info}{{mode="external",namespace="{NAMESPACE}",pool="pool"}} 1.0' in text
    assert f'{info}{{mode="managed",' not in text


@pytest.mark.parametrize("operator_config", [{"observe_interval": 0.3}])
async def test_an_external_pool_never_points_the_operator_at_another_namespaces_pool(
    cluster: Cluster, operator: Operator
) -> None:
    """The operator's pods may reach every pool it runs: an external pool whose endpoint
    leads to one of another namespace's (here its master pod, by a name that resolves to its
    IP) is not asked, and says so without naming that pool. A fake master on 127.0.0.1 (no
    Mooncake needed: what matters is whether it is asked) counts the requests."""
    asked: list[str] = []

    async def anything(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.Response(status=404)

    app = web.Application()
    app.router.add_get("/{tail:.*}", anything)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        other = pool_manifest("shared")  # another team's, in a namespace the operator watches
        other["metadata"]["namespace"] = TENANT_NAMESPACE
        await cluster.create(other)
        master_pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "shared-master-0",
                "namespace": TENANT_NAMESPACE,
                "labels": {names.LABEL_POOL: "shared", names.LABEL_COMPONENT: names.MASTER},
            },
            "spec": {"containers": [{"name": "master", "image": "mooncake"}]},
            "status": {"podIP": "127.0.0.1"},
        }
        await cluster.create(master_pod)
        spec = pool_spec(
            external={"masterServerAddress": f"localhost:{port}", "metricsEndpoints": [f"localhost:{port}"]}
        )
        del spec["image"], spec["store"]
        await cluster.create(vllm_deployment())
        await cluster.create(pool_manifest(spec=spec))

        def master_ready() -> dict[str, Any]:
            cluster.settle()
            return cluster.condition("pool", "MasterReady")

        refused = await eventually(
            lambda: master_ready().get("reason") == "EndpointRefused" and master_ready(), what="refused"
        )
        assert "spec.external.metricsEndpoints[0]" in refused["message"]
        assert "another namespace" in refused["message"] and "shared" not in refused["message"]
        await cluster.passes("pool", cluster.mark(), count=2)
        assert asked == []
        assert kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm")) == []

        # Negative control: once that pool's master is elsewhere, the endpoint is asked.
        pod_path = f"/api/v1/namespaces/{TENANT_NAMESPACE}/pods/{master_pod['metadata']['name']}"
        response = await cluster.api.delete(pod_path)
        assert response.status == 200, await response.text()
        await eventually(lambda: asked, what="the endpoint asked")
        await eventually(lambda: "answered HTTP 404" in master_ready()["message"], what="its answer")
    finally:
        await runner.cleanup()
