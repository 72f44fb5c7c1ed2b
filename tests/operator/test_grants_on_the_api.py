"""Grants on the emulated API with the real operator: a consumer attaches to a grant of its
namespace, a pool whose grants oversubscribe it cuts them and says so in their status, a
consumer naming a grant that is not there is refused and nothing is written; grants from the
namespaces a pool lists are cut with its own, a grant from any other is refused."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.connector.contract.tenant_policy import POLICY_FILE, policy_yaml
from kvpool.operator import names
from kvpool.operator.names import GRANTS
from testing.kube_api import (
    DEPLOYMENTS_PATH,
    GRANTS_PATH,
    NAMESPACE,
    POOLS_PATH,
    TENANT_NAMESPACE,
    Cluster,
    Fault,
    eventually,
)
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


async def test_a_grant_from_another_namespace_counts_only_while_the_pool_lists_it(
    cluster: Cluster, operator: Operator
) -> None:
    tenant = TENANT_NAMESPACE
    await cluster.create(vllm_deployment())
    await cluster.create(grant_manifest("team-a", "24MB"))
    await cluster.create(pool_manifest(spec=tenancy_spec("team-a")))
    await converge(cluster, generation=1)
    # Created after its pool: the grant handler finds the pool and refuses it.
    await cluster.create(grant_manifest("llm", "24MB", namespace=tenant, pool_namespace=NAMESPACE))

    def policy_text() -> str:
        return str(((cluster.get(CONFIGMAPS_PATH, "pool-tenants") or {}).get("data") or {}).get(POLICY_FILE))

    # Not listed: refused, and not in the master's policy.
    refused = await eventually(
        lambda: conditions(g := cluster.get(GRANTS_PATH, "llm", tenant)).get("Accepted") == "False" and g,
        what="the unlisted namespace's grant refused",
    )
    (accepted,) = refused["status"]["conditions"]
    assert accepted["reason"] == "NamespaceNotAllowed" and tenant in accepted["message"]
    assert "tenant" not in refused["status"] and f"{tenant}.llm" not in policy_text()
    # Listed: a tenant, cut with the pool's own grant, told where the master is.
    await cluster.patch_pool("pool", {"spec": {"tenancy": {"grantNamespaces": [tenant]}}})
    quotas = {f"{NAMESPACE}.team-a": 24 * MiB, f"{tenant}.llm": 24 * MiB}
    await eventually(lambda: policy_text() == policy_yaml(quotas), what="both grants in the policy")
    granted = await eventually(
        lambda: conditions(g := cluster.get(GRANTS_PATH, "llm", tenant)).get("Cut") == "True" and g,
        what="the listed namespace's grant cut",
    )
    assert granted["status"]["ceilingBytes"] == 16 * MiB and granted["status"]["tenant"] == f"{tenant}.llm"
    assert granted["status"]["masterServerAddress"] == f"pool-master.{NAMESPACE}.svc:50051"
    await eventually(
        lambda: cluster.pool_status("pool").get("grantsFromOtherNamespaces") == [f"{tenant}/llm"],
        what="the pool names the other namespace's grant",
    )
    # Unlisted again: out of the policy, and the grant is told so.
    await cluster.patch_pool("pool", {"spec": {"tenancy": {"grantNamespaces": []}}})
    withdrawn = await eventually(
        lambda: conditions(g := cluster.get(GRANTS_PATH, "llm", tenant)).get("Accepted") == "False" and g,
        what="the unlisted namespace's grant withdrawn",
    )
    assert [c["reason"] for c in withdrawn["status"]["conditions"]] == ["NamespaceNotAllowed"]
    await eventually(lambda: f"{tenant}.llm" not in policy_text(), what="the policy without it")
    await eventually(
        lambda: "grantsFromOtherNamespaces" not in cluster.pool_status("pool"),
        what="the pool names it no more",
    )


def tenant_deployment(namespace: str, name: str, consent: bool = True) -> dict[str, Any]:
    deployment = vllm_deployment(name, allow_pool="pool")
    deployment["metadata"]["namespace"] = namespace
    if consent:
        deployment["metadata"]["labels"][names.LABEL_ALLOW_POOL_NAMESPACE] = NAMESPACE
    return deployment


async def create_shared_pool(cluster: Cluster, *tenant_deployments: dict[str, Any]) -> None:
    """The pool's own consumer with its grant, and a grant ``llm`` in the tenant's namespace
    listing ``tenant_deployments`` (created too); the pool takes grants from that namespace."""
    await cluster.create(vllm_deployment())
    for deployment in tenant_deployments:
        await cluster.create(deployment)
    await cluster.create(grant_manifest("team-a", "8MB"))
    shared = grant_manifest("llm", "8MB", namespace=TENANT_NAMESPACE, pool_namespace=NAMESPACE)
    shared["spec"]["consumers"] = [consumer(d["metadata"]["name"]) for d in tenant_deployments]
    await cluster.create(shared)
    spec = tenancy_spec("team-a")
    spec["tenancy"]["grantNamespaces"] = [TENANT_NAMESPACE]
    await cluster.create(pool_manifest(spec=spec))


async def test_a_grants_consumers_in_its_namespace_are_rolled_and_released_with_it(
    cluster: Cluster, operator: Operator
) -> None:
    tenant = TENANT_NAMESPACE
    await create_shared_pool(
        cluster, tenant_deployment(tenant, "chat"), tenant_deployment(tenant, "batch", False)
    )

    def consumers() -> dict[str, dict[str, Any]]:
        cluster.settle()
        return {c["name"]: c for c in cluster.pool_status("pool").get("consumers") or []}

    await eventually(
        lambda: consumers().get(f"{tenant}/chat", {}).get("rolledOut"), what="team-b/chat rolled out"
    )
    chat = cluster.get(DEPLOYMENTS_PATH, "chat", tenant)
    assert chat is not None and tenant_of(chat) == f"{tenant}.llm"
    pod_labels = chat["spec"]["template"]["metadata"]["labels"]
    assert pod_labels[names.LABEL_POOL] == "pool" and pod_labels[names.LABEL_POOL_NAMESPACE] == NAMESPACE
    (mount,) = [v for v in chat["spec"]["template"]["spec"]["volumes"] if v.get("configMap")]
    configmap = cluster.get(CONFIGMAPS_PATH, mount["configMap"]["name"], tenant)
    assert configmap is not None and mount["configMap"]["name"] == "pool-llm-connector"
    granted = cluster.get(GRANTS_PATH, "llm", tenant)
    assert granted is not None
    assert [(o["kind"], o["uid"]) for o in configmap["metadata"]["ownerReferences"]] == [
        (GRANTS.kind, granted["metadata"]["uid"])
    ]
    # The one without consent naming the pool's namespace is left alone, and said so.
    batch = consumers()[f"{tenant}/batch"]
    assert not batch["rolledOut"] and names.LABEL_ALLOW_POOL_NAMESPACE in batch["message"]
    assert kv_flags(cluster.get(DEPLOYMENTS_PATH, "batch", tenant)) == []
    # The pool's own consumer in its namespace is as before.
    llm = cluster.get(DEPLOYMENTS_PATH, "llm")
    assert llm is not None and tenant_of(llm) == f"{NAMESPACE}.team-a"

    # The tenant reads where its consumers stand on its grant, not on the pool.
    def grant_consumers(grant: str) -> dict[str, dict[str, Any]]:
        status = (cluster.get(GRANTS_PATH, grant, tenant) or {}).get("status") or {}
        return {c["name"]: c for c in status.get("consumers") or []}

    await eventually(
        lambda: grant_consumers("llm").get("chat", {}).get("rolledOut"), what="chat on its grant"
    )
    told = grant_consumers("llm")["batch"]
    assert not told["rolledOut"] and names.LABEL_ALLOW_POOL_NAMESPACE in told["message"]
    # A second grant of the namespace listing chat too: chat stays the first grant's, and the
    # second says so.
    second = grant_manifest("more", "8MB", namespace=tenant, pool_namespace=NAMESPACE)
    second["spec"]["consumers"] = [consumer("chat")]
    await cluster.create(second)
    doubled = await eventually(lambda: grant_consumers("more").get("chat"), what="the second grant told")
    assert not doubled["rolledOut"] and "grant llm lists this Deployment too" in doubled["message"]
    chat = cluster.get(DEPLOYMENTS_PATH, "chat", tenant)
    assert chat is not None and tenant_of(chat) == f"{tenant}.llm"

    # Unlisting the namespace releases its consumers and deletes what the pool wrote there.
    await cluster.patch_pool("pool", {"spec": {"tenancy": {"grantNamespaces": []}}})
    await eventually(
        lambda: kv_flags(cluster.get(DEPLOYMENTS_PATH, "chat", tenant)) == [], what="chat released"
    )
    released = cluster.get(DEPLOYMENTS_PATH, "chat", tenant)
    assert released is not None
    assert names.LABEL_POOL_NAMESPACE not in released["metadata"]["labels"]
    assert names.LABEL_POOL_NAMESPACE not in (released["spec"]["template"]["metadata"].get("labels") or {})
    await eventually(
        lambda: cluster.get(CONFIGMAPS_PATH, "pool-llm-connector", tenant) is None,
        what="the grant's ConfigMap deleted",
    )
    await eventually(
        lambda: not any(name.startswith(f"{tenant}/") for name in consumers()),
        what="the pool lists them no more",
    )


async def test_an_invalid_spec_leaves_what_the_pool_wrote_in_other_namespaces(
    cluster: Cluster, operator: Operator
) -> None:
    """An invalid spec changes nothing: the grant's consumers in another namespace keep their
    ConfigMap (a restarted pod mounts it) and the pool keeps naming the grant it serves."""
    tenant = TENANT_NAMESPACE
    await create_shared_pool(cluster, tenant_deployment(tenant, "chat"))

    def chat_rolled_out() -> bool:
        cluster.settle()
        consumers = cluster.pool_status("pool").get("consumers") or []
        return any(c["name"] == f"{tenant}/chat" and c.get("rolledOut") for c in consumers)

    await eventually(chat_rolled_out, what="team-b/chat rolled out")
    assert cluster.pool_status("pool").get("grantsFromOtherNamespaces") == [f"{tenant}/llm"]
    chat_flags = kv_flags(cluster.get(DEPLOYMENTS_PATH, "chat", tenant))
    served = cluster.get(CONFIGMAPS_PATH, "pool-llm-connector", tenant)
    assert chat_flags and served is not None

    await cluster.patch_pool("pool", {"spec": {"master": {"replicas": 2}}})  # no HA: one master
    await eventually(
        lambda: cluster.condition("pool", "ConfigValid").get("status") == "False", what="the spec refused"
    )
    await cluster.quiet("pool")
    assert cluster.get(CONFIGMAPS_PATH, "pool-llm-connector", tenant) == served
    assert kv_flags(cluster.get(DEPLOYMENTS_PATH, "chat", tenant)) == chat_flags
    assert cluster.pool_status("pool").get("grantsFromOtherNamespaces") == [f"{tenant}/llm"]


async def test_deleting_the_pool_releases_the_grants_consumers_and_keeps_the_grant(
    cluster: Cluster, operator: Operator
) -> None:
    tenant = TENANT_NAMESPACE
    await create_shared_pool(cluster, tenant_deployment(tenant, "chat"))
    await cluster.create(grant_manifest("other", "8MB", pool="elsewhere"))  # another pool's
    await converge(cluster)  # kopf done with the pool: its teardown is not raced by a pass
    await eventually(
        lambda: kv_flags(cluster.get(DEPLOYMENTS_PATH, "chat", tenant)) != [], what="chat patched"
    )
    await cluster.delete_pool("pool")
    await eventually(lambda: cluster.get(POOLS_PATH, "pool") is None, what="the pool gone")
    assert kv_flags(cluster.get(DEPLOYMENTS_PATH, "chat", tenant)) == []
    assert cluster.get(CONFIGMAPS_PATH, "pool-llm-connector", tenant) is None
    # The grants stay, no longer claiming a share of a pool that is gone.
    for namespace, name in ((tenant, "llm"), (NAMESPACE, "team-a")):
        kept = cluster.get(GRANTS_PATH, name, namespace)
        assert kept is not None
        (accepted,) = kept["status"]["conditions"]
        assert (accepted["status"], accepted["reason"]) == ("False", "PoolNotFound")
        assert "tenant" not in kept["status"] and "ceilingBytes" not in kept["status"]
    # Another pool's grant in the namespace is not the deleted pool's to speak for.
    other = cluster.get(GRANTS_PATH, "other")
    assert other is not None
    assert [c["message"] for c in conditions_of(other)] == [f"pool {NAMESPACE}/elsewhere not found"]


def failed_teardowns(url: str) -> float:
    """Teardowns the operator counted failed (``kvpool_operator_reconcile_errors``, trigger delete)."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kvpool_operator_reconcile_errors_total" and s.labels.get("trigger") == "delete"
    )


async def test_a_grant_namespace_the_api_fails_to_list_keeps_the_pool_until_released(
    cluster: Cluster, operator: Operator
) -> None:
    """Teardown tries again while the API fails (500) to list a grant namespace's Deployments:
    the ConfigMap its consumers mount stays until they are released (only a namespace the
    operator may not read, 403 or 404, is skipped)."""
    tenant = TENANT_NAMESPACE
    await create_shared_pool(cluster, tenant_deployment(tenant, "chat"))
    await converge(cluster)
    await eventually(
        lambda: kv_flags(cluster.get(DEPLOYMENTS_PATH, "chat", tenant)) != [], what="chat patched"
    )
    outage = cluster.api.fail(Fault("GET", "deployments", 500, times=10_000, namespace=tenant))
    await cluster.delete_pool("pool")
    await eventually(lambda: failed_teardowns(operator.metrics_url) >= 2, what="teardown tried twice")
    assert cluster.get(POOLS_PATH, "pool") is not None
    assert kv_flags(cluster.get(DEPLOYMENTS_PATH, "chat", tenant)) != []
    assert cluster.get(CONFIGMAPS_PATH, "pool-llm-connector", tenant) is not None, "still mounted"
    outage.times = 0
    await eventually(lambda: cluster.get(POOLS_PATH, "pool") is None, what="the pool gone")
    assert kv_flags(cluster.get(DEPLOYMENTS_PATH, "chat", tenant)) == []


async def test_a_grant_made_before_its_pool_is_answered_when_the_pool_comes(
    cluster: Cluster, operator: Operator
) -> None:
    tenant = TENANT_NAMESPACE
    # Made first: no pool to serve it yet, and it says so.
    await cluster.create(grant_manifest("llm", "24MB", namespace=tenant, pool_namespace=NAMESPACE))
    waiting = await eventually(
        lambda: conditions(g := cluster.get(GRANTS_PATH, "llm", tenant)).get("Accepted") == "False" and g,
        what="the grant waiting for its pool",
    )
    (accepted,) = waiting["status"]["conditions"]
    assert accepted["reason"] == "PoolNotFound" and f"{NAMESPACE}/pool" in accepted["message"]
    # The pool comes without listing the grant's namespace: the grant is told (it did not
    # change, so only the pool's pass can tell it).
    await cluster.create(vllm_deployment())
    await cluster.create(grant_manifest("team-a", "24MB"))
    await cluster.create(pool_manifest(spec=tenancy_spec("team-a")))
    await eventually(
        lambda: (
            [c["reason"] for c in conditions_of(cluster.get(GRANTS_PATH, "llm", tenant))]
            == ["NamespaceNotAllowed"]
        ),
        what="the unlisted grant refused",
    )
    await converge(cluster, generation=1)
    policy = cluster.get(CONFIGMAPS_PATH, "pool-tenants")
    assert policy is not None and f"{tenant}.llm" not in policy["data"][POLICY_FILE]


def conditions_of(obj: dict[str, Any] | None) -> list[dict[str, Any]]:
    return list(((obj or {}).get("status") or {}).get("conditions") or [])
