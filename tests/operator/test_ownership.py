"""The pool touches only objects that carry its ownerReference: others of the same name are
named in a ``Conflict`` condition and an Event, never patched, never deleted."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.operator.plan import build_plan
from testing.kube_api import DEPLOYMENTS_PATH, NAMESPACE, POOLS_PATH, Cluster, eventually
from testing.operator_objects import (
    Operator,
    converge,
    path_of,
    pool_manifest,
    pool_spec,
    vllm_deployment,
)

pytestmark = pytest.mark.asyncio
CONFIGMAPS = "v1/configmaps"


def unrelated_configmap(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"team": "web"}},
        "data": {"nginx.conf": "server {}"},
    }


def writes_to(cluster: Cluster, path: str) -> list[str]:
    return [f"{r.method} {r.url.path}" for r in cluster.writes() if r.url.path == path]


async def test_objects_it_did_not_create_are_left_alone(cluster: Cluster, operator: Operator) -> None:
    # A namespace that already holds a Deployment "pool-master" and a ConfigMap "pool-connector".
    await cluster.create(vllm_deployment("pool-master", allow_pool=None))
    await cluster.create(unrelated_configmap("pool-connector"))
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest())

    condition = await eventually(
        lambda: (
            cluster.condition("pool", "Conflict").get("status") == "True"
            and cluster.condition("pool", "Conflict")
        ),
        what="Conflict=True",
    )
    assert condition["reason"] == "NotOwned"
    message = condition["message"]
    for named in ("Deployment team-a/pool-master", "ConfigMap team-a/pool-connector"):
        assert f"{named} exists and is not this pool's" in message
    assert message.count("[ownership]") == 2
    events = await eventually(lambda: len(cluster.events("NotOwned")) == 2 and cluster.events("NotOwned"))
    assert sorted(e["message"] for e in events) == sorted(message.split("; "))
    assert all(e["type"] == "Warning" and e["involvedObject"]["name"] == "pool" for e in events)
    status = cluster.pool_status("pool")
    assert status["phase"] == "Conflict"
    master_ready = cluster.condition("pool", "MasterReady")
    assert (master_ready["status"], master_ready["reason"]) == ("False", "Conflict")

    # What is the pool's own is there; the consumer is held back (it would read the foreign ConfigMap).
    pool_uid = cluster.get(POOLS_PATH, "pool")["metadata"]["uid"]
    foreign = {("Deployment", "pool-master"), ("ConfigMap", "pool-connector")}
    for child in build_plan("pool", NAMESPACE, pool_spec()).children:
        if (child["kind"], child["metadata"]["name"]) in foreign:
            continue
        live = cluster.get(path_of(child), child["metadata"]["name"])
        assert live is not None and live["metadata"]["ownerReferences"][0]["uid"] == pool_uid
    assert status["consumers"][0]["rolledOut"] is False
    assert "held back" in status["consumers"][0]["message"]

    # Settled: passes over the pool write nothing (no patch, no repeated Event).
    await eventually(lambda: cluster.handled("pool"), what="kopf is done with the pool")
    start = cluster.mark()
    end = await cluster.passes("pool", start, count=3)
    assert cluster.writes(start, end) == []

    # Teardown deletes what is the pool's and nothing else.
    await cluster.delete_pool("pool")
    await eventually(lambda: cluster.get(POOLS_PATH, "pool") is None, what="pool gone")
    assert cluster.get("v1/services", "pool-master") is None
    assert cluster.get(DEPLOYMENTS_PATH, "pool-store") is None
    for path, name in (
        (DEPLOYMENTS_PATH, "pool-master"),
        (CONFIGMAPS, "pool-connector"),
        (DEPLOYMENTS_PATH, "llm"),
    ):
        (only,) = cluster.history(path, name)  # never written after its creation
        assert cluster.get(path, name) == dict(only.raw), name
    assert writes_to(cluster, "/apis/apps/v1/namespaces/team-a/deployments/pool-master") == []
    assert writes_to(cluster, "/api/v1/namespaces/team-a/configmaps/pool-connector") == []
    assert writes_to(cluster, "/apis/apps/v1/namespaces/team-a/deployments/llm") == []


async def test_a_child_replaced_by_someone_else_is_not_overwritten(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest())
    await converge(cluster, generation=1)
    # Someone deletes the pool's ConfigMap and puts their own in its place. The operator may
    # write its own back in between (a 409 on their create): they delete it again and retry.
    path = f"/api/v1/namespaces/{NAMESPACE}/configmaps"
    for _ in range(20):
        response = await cluster.api.delete(f"{path}/pool-connector")
        assert response.status in (200, 404)
        start = cluster.mark()
        created = await cluster.api.post(path, json=unrelated_configmap("pool-connector"))
        if created.status in (200, 201):
            break
        assert created.status == 409, await created.text()
    else:
        raise AssertionError("the operator wrote its ConfigMap back before every create")
    await eventually(
        lambda: "ConfigMap team-a/pool-connector" in cluster.condition("pool", "Conflict").get("message", ""),
        what="the replaced ConfigMap is named",
    )
    assert cluster.get(CONFIGMAPS, "pool-connector")["data"] == {"nginx.conf": "server {}"}
    assert writes_to(cluster, "/api/v1/namespaces/team-a/configmaps/pool-connector") == []
    # The consumer keeps what it runs; nothing of it is rewritten while the conflict lasts.
    assert [r for r in cluster.writes(start) if r.url.path.endswith("/deployments/llm")] == []
