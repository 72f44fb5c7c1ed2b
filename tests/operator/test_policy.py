"""The operator's own settings (an image allowlist, replica caps) and warnings, end to end:
a refused pool gets ConfigValid=False and an Event naming the field and rule, and nothing
is written; a warned-about pool runs, and says so once."""

from __future__ import annotations

import pytest

from kvpool.operator.policy import OperatorPolicy
from testing.kube_api import Cluster, eventually
from testing.operator_objects import Operator, converge, pool_manifest, pool_spec, vllm_deployment
from tests.operator.test_operator_endpoints import admit

pytestmark = pytest.mark.asyncio
POLICY = OperatorPolicy(image_prefixes=("registry.internal/",), max_store_replicas=2)
RDMA = {"segmentSize": "1GB", "protocol": "rdma", "rdmaDevices": ["mlx5_0"]}


@pytest.mark.parametrize("operator_config", [{"policy": POLICY}])
async def test_a_pool_beyond_the_policy_is_refused_and_nothing_written(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest(spec=pool_spec(store={"segmentSize": "1GB", "replicas": 3})))
    condition = await eventually(
        lambda: (
            cluster.condition("pool", "ConfigValid").get("status") == "False"
            and cluster.condition("pool", "ConfigValid")
        )
    )
    message = condition["message"]
    assert "spec.image: image 'registry.example/mooncake:0.3.13' starts with none of the allowed" in message
    assert "[image-allowlist]" in message
    assert "spec.store.replicas: 3 replicas are above the operator's cap of 2 [replica-cap]" in message
    (event,) = await eventually(lambda: cluster.events("InvalidSpec"))
    assert event["message"] == message and event["type"] == "Warning"
    await eventually(lambda: cluster.handled("pool"), what="kopf is done with the pool")
    written = [r for r in cluster.writes() if r.resource is not None and r.resource.plural != "events"]
    assert {r.resource.plural for r in written} <= {"mooncakekvpools"}  # its status and kopf's annotations

    # Within the policy, it runs.
    await cluster.patch_pool(
        "pool", {"spec": {"image": "registry.internal/mooncake:1", "store": {"replicas": 2}}}
    )
    await converge(cluster, generation=2)


async def test_an_rdma_pool_is_warned_about_pod_security_once(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest(spec=pool_spec(store=RDMA)))
    status = await converge(cluster, generation=1)
    (warning,) = status["warnings"]
    assert warning.startswith("spec.store.protocol: RDMA store pods add the IPC_LOCK capability")
    assert warning.endswith("[pod-security-restricted]")
    (event,) = await eventually(lambda: cluster.events("PoolWarning"))
    assert event["message"] == warning and event["type"] == "Warning"
    start = cluster.mark()
    end = await cluster.passes("pool", start, count=2)
    assert cluster.writes(start, end) == []


@pytest.mark.parametrize("operator_config", [{"webhook": True, "policy": POLICY}])
async def test_the_webhook_applies_the_policy_and_warns(cluster: Cluster, operator: Operator) -> None:
    assert operator.webhook_url is not None
    url = f"{operator.webhook_url}/validate-pool"
    refused = await admit(url, pool_spec())
    assert refused["allowed"] is False and "[image-allowlist]" in refused["status"]["message"]
    warned = await admit(url, pool_spec(image="registry.internal/mooncake:1", store=RDMA))
    assert warned["allowed"] is True
    (warning,) = warned["warnings"]
    assert "IPC_LOCK" in warning and "[pod-security-restricted]" in warning
