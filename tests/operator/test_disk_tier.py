"""A store pod's disk tier: its volume (never a host path), the offload settings on master
and stores, refusals by field and rule, and the tier going with the pool."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.connector.local.disk_tier import DiskTier
from kvpool.operator import disk_tier
from kvpool.operator.plan import build_plan
from testing.kube_api import DEPLOYMENTS_PATH, NAMESPACE, Cluster
from testing.operator_objects import Operator, converge, pool_manifest, pool_spec, vllm_deployment

TIER = {
    "capacity": "64MB",
    "keyLimit": 5000,
    "evictionPolicy": "fifo",
    "highWatermark": 0.85,
    "lowWatermark": 0.7,
}


def children(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    plan = build_plan("pool", NAMESPACE, raw)
    assert plan.problems == []
    return {c["metadata"]["name"]: c for c in plan.children if c["kind"] == "Deployment"}


def pod_of(deployment: dict[str, Any]) -> dict[str, Any]:
    pod: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return pod


def test_store_pods_get_the_tier_as_the_local_pool_configures_it() -> None:
    objs = children(pool_spec(store={"segmentSize": "32MB", "diskTier": TIER}))
    store, master = pod_of(objs["pool-store"]), pod_of(objs["pool-master"])
    (container,) = store["containers"]
    assert disk_tier.OFFLOAD_FLAG in container["args"]
    assert disk_tier.OFFLOAD_FLAG in master["containers"][0]["args"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    expected = DiskTier(
        capacity=64 << 20, key_limit=5000, eviction="fifo", high_watermark=0.85, low_watermark=0.7
    ).offload_env(disk_tier.MOUNT_PATH)
    assert {k: env[k] for k in expected} == expected
    assert {"name": disk_tier.VOLUME, "mountPath": disk_tier.MOUNT_PATH} in container["volumeMounts"]
    (volume,) = [v for v in store["volumes"] if v["name"] == disk_tier.VOLUME]
    claim = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "80Mi"}}}
    assert not any("hostPath" in v for v in store["volumes"])


def test_an_empty_dir_tier_and_a_pool_without_one() -> None:
    tier = {**TIER, "volume": {"type": "emptyDir", "size": "100MB"}}
    store = pod_of(children(pool_spec(store={"diskTier": tier}))["pool-store"])
    assert {"name": disk_tier.VOLUME, "emptyDir": {"sizeLimit": "100Mi"}} in store["volumes"]
    claimed = {**TIER, "volume": {"storageClassName": "fast-ssd"}}
    store = pod_of(children(pool_spec(store={"diskTier": claimed}))["pool-store"])
    (volume,) = [v for v in store["volumes"] if v["name"] == disk_tier.VOLUME]
    assert volume["ephemeral"]["volumeClaimTemplate"]["spec"]["storageClassName"] == "fast-ssd"
    plain = children(pool_spec())
    for name in ("pool-store", "pool-master"):
        (container,) = pod_of(plain[name])["containers"]
        assert disk_tier.OFFLOAD_FLAG not in container["args"]
        assert not any(e["name"].startswith("MOONCAKE_OFFLOAD") for e in container["env"])


@pytest.mark.parametrize(
    ("store", "field", "rule"),
    [
        ({"diskTier": {**TIER, "lowWatermark": 0.9, "highWatermark": 0.8}}, "lowWatermark", "low watermark"),
        ({"diskTier": {**TIER, "capacity": "4MB"}}, "capacity", "at most the capacity"),
        ({"mode": "embedded", "diskTier": TIER}, "diskTier", "needs store pods"),
        # A volume smaller than the tier: Mooncake fills it past its end.
        ({"diskTier": {**TIER, "volume": {"size": "32MB"}}}, "volume.size", "cannot hold"),
        ({"diskTier": {**TIER, "volume": {"type": "emptyDir", "size": "63MB"}}}, "volume.size", "64Mi"),
    ],
)
def test_a_tier_that_breaks_a_rule_is_refused_by_field(store: dict[str, Any], field: str, rule: str) -> None:
    plan = build_plan("pool", NAMESPACE, pool_spec(store=store))
    assert [p.field for p in plan.problems] == [
        f"spec.store.{field}" if field == "diskTier" else f"spec.store.diskTier.{field}"
    ]
    assert rule in plan.problems[0].message
    assert plan.children == []


def test_a_host_path_is_no_volume_a_tier_takes() -> None:
    plan = build_plan(
        "pool", NAMESPACE, pool_spec(store={"diskTier": {**TIER, "volume": {"hostPath": "/mnt"}}})
    )
    assert [p.field for p in plan.problems] == ["spec.store.diskTier.volume.hostPath"]
    assert plan.children == []


@pytest.mark.asyncio
async def test_the_tier_reaches_the_cluster_owned_by_the_pool(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest(spec=pool_spec(store={"diskTier": TIER})))
    await converge(cluster, generation=1)
    store = cluster.get(DEPLOYMENTS_PATH, "pool-store")
    assert store is not None
    (owner,) = store["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("MooncakeKVPool", "pool", True)
    volumes = {v["name"]: v for v in pod_of(store)["volumes"]}
    assert "volumeClaimTemplate" in volumes[disk_tier.VOLUME]["ephemeral"]
