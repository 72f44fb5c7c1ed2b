"""Grants on the emulated API with the real operator: a consumer attaches to a grant of its
namespace, a pool whose grants oversubscribe it cuts them and says so in their status, a
consumer naming a grant that is not there is refused and nothing is written; grants from the
namespaces a pool lists are cut with its own, a grant from any other is refused."""

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


def grant_manifest(
    name: str, ceiling: str, pool: str = "pool", namespace: str = NAMESPACE, pool_namespace: str | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": f"{GRANTS.group}/{GRANTS.version}",
        "kind": GRANTS.kind,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "pool": pool,
            "ceiling": ceiling,
            **({"poolNamespace": pool_namespace} if pool_namespace else {}),
        },
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


async def test_grants_from_a_listed_namespace_are_cut_with_the_pools_and_others_refused(
    cluster: Cluster, operator: Operator
) -> None:
    tenant, stranger = "team-b", "team-c"
    await cluster.create(vllm_deployment())
    await cluster.create(grant_manifest("team-a", "24MB"))
    await cluster.create(grant_manifest("llm", "24MB", namespace=tenant, pool_namespace=NAMESPACE))
    await cluster.create(grant_manifest("llm", "24MB", namespace=stranger, pool_namespace=NAMESPACE))
    spec = tenancy_spec("team-a")
    spec["tenancy"]["grantNamespaces"] = [tenant]
    await cluster.create(pool_manifest(spec=spec))
    await converge(cluster, generation=1)

    policy = cluster.get(CONFIGMAPS_PATH, "pool-tenants")
    assert policy is not None
    quotas = {f"{NAMESPACE}.team-a": 24 * MiB, f"{tenant}.llm": 24 * MiB}
    assert policy["data"][POLICY_FILE] == policy_yaml(quotas)
    granted = await eventually(
        lambda: conditions(g := cluster.get(GRANTS_PATH, "llm", tenant)).get("Cut") == "True" and g,
        what="the listed namespace's grant cut",
    )
    assert granted["status"]["ceilingBytes"] == 16 * MiB and granted["status"]["tenant"] == f"{tenant}.llm"
    assert granted["status"]["masterServerAddress"] == f"pool-master.{NAMESPACE}.svc:50051"
    refused = await eventually(
        lambda: conditions(g := cluster.get(GRANTS_PATH, "llm", stranger)).get("Accepted") == "False" and g,
        what="the unlisted namespace's grant refused",
    )
    (accepted,) = refused["status"]["conditions"]
    assert accepted["reason"] == "NamespaceNotAllowed" and stranger in accepted["message"]
    assert "tenant" not in refused["status"]
    # Listing it later makes it a tenant (the next grant event or pass).
    await cluster.patch_pool("pool", {"spec": {"tenancy": {"grantNamespaces": [tenant, stranger]}}})
    await eventually(
        lambda: (
            f"{stranger}.llm"
            in ((cluster.get(CONFIGMAPS_PATH, "pool-tenants") or {}).get("data") or {}).get(POLICY_FILE, "")
        ),
        what="the newly listed namespace's grant in the policy",
    )
    await eventually(
        lambda: (
            cluster.pool_status("pool").get("grantsFromOtherNamespaces")
            == [f"{tenant}/llm", f"{stranger}/llm"]
        ),
        what="the pool names both namespaces' grants",
    )
    # Unlisting a namespace takes its grant out of the policy and tells the grant so.
    await cluster.patch_pool("pool", {"spec": {"tenancy": {"grantNamespaces": [stranger]}}})
    withdrawn = await eventually(
        lambda: conditions(g := cluster.get(GRANTS_PATH, "llm", tenant)).get("Accepted") == "False" and g,
        what="the unlisted namespace's grant withdrawn",
    )
    assert [c["reason"] for c in withdrawn["status"]["conditions"]] == ["NamespaceNotAllowed"]
    tenants = ((cluster.get(CONFIGMAPS_PATH, "pool-tenants") or {}).get("data") or {})[POLICY_FILE]
    assert f"{tenant}.llm" not in tenants and f"{stranger}.llm" in tenants
    assert cluster.pool_status("pool").get("grantsFromOtherNamespaces") == [f"{stranger}/llm"]
