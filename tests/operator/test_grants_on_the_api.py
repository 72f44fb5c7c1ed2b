"""Grants on the emulated API with the real operator: a consumer attaches to a grant of its
namespace, a pool whose grants oversubscribe it cuts them and says so in their status, a
consumer naming a grant that is not there is refused and nothing is written."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvpool.connector.contract.tenant_policy import POLICY_FILE, policy_yaml
from kvpool.operator.names import GRANTS
from testing.kube_api import DEPLOYMENTS_PATH, GRANTS_PATH, NAMESPACE, Cluster, eventually
from testing.operator_objects import (
    Operator,
    consumer,
    converge,
    kv_flags,
    pool_manifest,
    pool_spec,
    vllm_deployment,
)

pytestmark = pytest.mark.asyncio
MiB = 1 << 20
CONFIGMAPS_PATH = "v1/configmaps"


def grant_manifest(name: str, ceiling: str, pool: str = "pool") -> dict[str, Any]:
    return {
        "apiVersion": f"{GRANTS.group}/{GRANTS.version}",
        "kind": GRANTS.kind,
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"pool": pool, "ceiling": ceiling},
    }


def tenancy_spec(grant: str) -> dict[str, Any]:
    return pool_spec(
        tenancy={"enabled": True},
        store={"segmentSize": "16MB", "replicas": 2},
        consumers=[{**consumer(), "grant": grant}],
    )


def conditions(obj: dict[str, Any] | None) -> dict[str, str]:
    return {c["type"]: c["status"] for c in ((obj or {}).get("status") or {}).get("conditions") or []}


def tenant_of(llm: dict[str, Any]) -> str:
    (flag,) = kv_flags(llm)
    config = json.loads(flag.split("=", 1)[1])
    return str(config["kv_connector_extra_config"]["tenant"])


async def test_oversubscribing_grants_are_cut_and_the_consumer_gets_its_tenant(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create(vllm_deployment())
    await cluster.create(grant_manifest("team-a", "24MB"))
    await cluster.create(grant_manifest("team-b", "24MB"))
    await cluster.create(pool_manifest(spec=tenancy_spec("team-a")))
    await converge(cluster, generation=1)

    policy = cluster.get(CONFIGMAPS_PATH, "pool-tenants")
    assert policy is not None
    quotas = {f"{NAMESPACE}.team-a": 24 * MiB, f"{NAMESPACE}.team-b": 24 * MiB}
    assert policy["data"][POLICY_FILE] == policy_yaml(quotas)
    llm = cluster.get(DEPLOYMENTS_PATH, "llm")
    assert llm is not None and tenant_of(llm) == f"{NAMESPACE}.team-a"
    for name in ("team-a", "team-b"):
        granted = await eventually(
            lambda name=name: (
                conditions(cluster.get(GRANTS_PATH, name)).get("Cut") == "True"
                and cluster.get(GRANTS_PATH, name)
            ),
            what=f"{name} cut",
        )
        assert granted["status"]["ceilingBytes"] == 16 * MiB and granted["status"]["ceiling"] == "16Mi"
        assert conditions(granted)["Accepted"] == "True"

    # A grant that comes later is a pass at once (the operator watches grants): a third share.
    await cluster.create(grant_manifest("team-c", "24MB"))
    third = 32 * MiB // 3
    await eventually(
        lambda: (
            (cluster.get(GRANTS_PATH, "team-a") or {}).get("status", {}).get("ceilingBytes")
            in (third, third + 1)
        ),
        what="team-a cut to a third",
    )
    policy = cluster.get(CONFIGMAPS_PATH, "pool-tenants")
    assert policy is not None and f"name: {NAMESPACE}.team-c" in policy["data"][POLICY_FILE]


async def test_a_consumer_naming_a_missing_grant_is_refused_and_nothing_is_written(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest(spec=tenancy_spec("team-x")))
    status = await eventually(
        lambda: (
            conditions({"status": cluster.pool_status("pool")}).get("ConfigValid") == "False"
            and cluster.pool_status("pool")
        ),
        what="ConfigValid=False",
    )
    (valid,) = [c for c in status["conditions"] if c["type"] == "ConfigValid"]
    assert "spec.consumers[0].grant" in valid["message"] and "grant-not-found" in valid["message"]
    assert cluster.get(DEPLOYMENTS_PATH, "pool-master") is None
    assert cluster.get(CONFIGMAPS_PATH, "pool-tenants") is None
