"""External pools on the emulated API: the operator runs nothing for them, takes away what the
pool ran before, and rolls consumers onto the named master. (Observing a real external master:
``test_real_mooncake.py``.)"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from kvpool.operator.metric_names import POOL_INFO
from kvpool.operator.names import NETWORK_POLICIES, SERVICES
from testing.kube_api import DEPLOYMENTS_PATH, NAMESPACE, Cluster, eventually
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
