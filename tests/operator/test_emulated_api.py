"""The emulated API behaves like a real API server where the operator depends on it.

Over HTTP, as the operator meets it: server-side defaults, the CRD's pruning and defaults,
the status subresource, 409 on stale writes, generation, label selectors.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.operator.names import POOLS
from testing.kube_api import DEPLOYMENTS_PATH, NAMESPACE, POOLS_PATH, Cluster
from testing.operator_objects import pool_manifest, pool_spec, vllm_deployment

pytestmark = pytest.mark.asyncio
DEPLOYMENT_URL = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments"
MERGE = {"Content-Type": "application/merge-patch+json"}


async def post(cluster: Cluster, url: str, obj: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    response = await cluster.api.post(url, json=obj)
    return response.status, await response.json()


async def patch(cluster: Cluster, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    response = await cluster.api.patch(url, json=body, headers=MERGE)
    return response.status, await response.json()


def with_config_volume(deployment: dict[str, Any]) -> dict[str, Any]:
    pod = deployment["spec"]["template"]["spec"]
    pod["volumes"] = [{"name": "conf", "configMap": {"name": "conf"}}]
    container = pod["containers"][0]
    container["env"].append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    container["ports"] = [{"name": "http", "containerPort": 8000}]
    container["readinessProbe"] = {"httpGet": {"path": "/health", "port": "http"}}
    return deployment


async def test_deployments_get_the_servers_defaults(cluster: Cluster) -> None:
    status, created = await post(cluster, DEPLOYMENT_URL, with_config_volume(vllm_deployment()))
    assert status in (200, 201)
    spec = created["spec"]
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": "25%"},
    }
    assert (spec["revisionHistoryLimit"], spec["progressDeadlineSeconds"]) == (10, 600)
    pod = spec["template"]["spec"]
    assert pod["volumes"] == [{"name": "conf", "configMap": {"name": "conf", "defaultMode": 420}}]
    assert (pod["restartPolicy"], pod["dnsPolicy"], pod["terminationGracePeriodSeconds"]) == (
        "Always",
        "ClusterFirst",
        30,
    )
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"] == {"fieldPath": "status.podIP", "apiVersion": "v1"}
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    probe = container["readinessProbe"]
    assert probe["httpGet"]["scheme"] == "HTTP"
    assert (probe["timeoutSeconds"], probe["periodSeconds"], probe["failureThreshold"]) == (1, 10, 3)
    assert container["terminationMessagePolicy"] == "File"
    assert created["metadata"]["generation"] == 1 and created["metadata"]["uid"]


async def test_services_and_network_policies_get_theirs(cluster: Cluster) -> None:
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "s", "namespace": NAMESPACE},
        "spec": {"selector": {"a": "b"}, "ports": [{"name": "p", "port": 80}]},
    }
    _, created = await post(cluster, f"/api/v1/namespaces/{NAMESPACE}/services", service)
    assert created["spec"]["ports"] == [{"name": "p", "port": 80, "protocol": "TCP", "targetPort": 80}]
    assert created["spec"]["type"] == "ClusterIP" and created["spec"]["sessionAffinity"] == "None"
    ip = created["spec"]["clusterIP"]
    _, patched = await patch(
        cluster, f"/api/v1/namespaces/{NAMESPACE}/services/s", {"metadata": {"labels": {"x": "y"}}}
    )
    assert patched["spec"]["clusterIP"] == ip  # allocated once

    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "np", "namespace": NAMESPACE},
        "spec": {"podSelector": {}, "ingress": [{"ports": [{"port": 80}]}]},
    }
    _, created = await post(
        cluster, f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies", policy
    )
    assert created["spec"]["policyTypes"] == ["Ingress"]
    assert created["spec"]["ingress"] == [{"ports": [{"port": 80, "protocol": "TCP"}]}]


async def test_pools_are_pruned_and_defaulted_by_the_crd_schema(cluster: Cluster) -> None:
    manifest = pool_manifest(spec=pool_spec(master={"replicas": 1, "surprise": True}))
    manifest["spec"]["unknown"] = {"x": 1}
    manifest["status"] = {"phase": "Ready"}
    created = await cluster.create(manifest)
    spec = created["spec"]
    assert "unknown" not in spec and "surprise" not in spec["master"]
    assert spec["master"]["rpcPort"] == 50051 and spec["imagePullPolicy"] == "IfNotPresent"
    assert spec["connector"]["metadata_server"] == "P2PHANDSHAKE"
    assert spec["consumers"][0]["kvRole"] == "kv_both"
    assert "status" not in created  # the status subresource: set only through /status
    assert created["metadata"]["generation"] == 1


async def test_status_is_a_subresource_and_generation_follows_the_spec(cluster: Cluster) -> None:
    await cluster.create(pool_manifest())
    url = POOLS.path(NAMESPACE, "pool")
    _, after = await patch(
        cluster, url, {"metadata": {"annotations": {"a": "b"}}, "status": {"phase": "Ready"}}
    )
    assert after["metadata"]["generation"] == 1 and "status" not in after
    _, after = await patch(cluster, url + "/status", {"status": {"phase": "Ready"}, "spec": {"image": "x:1"}})
    assert after["status"] == {"phase": "Ready"}
    assert after["spec"]["image"] == pool_spec()["image"] and after["metadata"]["generation"] == 1
    _, after = await patch(cluster, url, {"spec": {"image": "x:2"}})
    assert after["metadata"]["generation"] == 2 and after["status"] == {"phase": "Ready"}
    # A write of what the server already holds (defaults included) changes nothing.
    version = after["metadata"]["resourceVersion"]
    _, again = await patch(cluster, url, {"spec": {"imagePullPolicy": "IfNotPresent"}})
    assert again["metadata"]["resourceVersion"] == version and again["metadata"]["generation"] == 2


async def test_stale_writes_get_409(cluster: Cluster) -> None:
    _, created = await post(cluster, DEPLOYMENT_URL, vllm_deployment())
    url = f"{DEPLOYMENT_URL}/llm"
    version, uid = created["metadata"]["resourceVersion"], created["metadata"]["uid"]
    status, _ = await patch(cluster, url, {"metadata": {"resourceVersion": version, "labels": {"a": "1"}}})
    assert status == 200
    status, body = await patch(cluster, url, {"metadata": {"resourceVersion": version, "labels": {"a": "2"}}})
    assert status == 409 and "resourceVersion" in body["message"]
    status, _ = await patch(cluster, url, {"metadata": {"uid": "someone-else", "labels": {"a": "3"}}})
    assert status == 409
    stored = cluster.get(DEPLOYMENTS_PATH, "llm")
    assert stored is not None and stored["metadata"]["labels"]["a"] == "1"
    response = await cluster.api.delete(url, json={"preconditions": {"uid": "someone-else"}})
    assert response.status == 409 and cluster.get(DEPLOYMENTS_PATH, "llm") is not None
    response = await cluster.api.delete(url, json={"preconditions": {"uid": uid}})
    assert response.status == 200 and cluster.get(DEPLOYMENTS_PATH, "llm") is None


async def test_lists_honour_label_selectors(cluster: Cluster) -> None:
    await post(cluster, DEPLOYMENT_URL, vllm_deployment("a"))
    await post(cluster, DEPLOYMENT_URL, vllm_deployment("b", allow_pool=None))
    for selector, expected in (
        ("kvpool.mooncake.io/allow-pool=pool", ["a"]),
        ("!kvpool.mooncake.io/allow-pool", ["b"]),
        ("app!=a", ["b"]),
        ("", ["a", "b"]),
    ):
        response = await cluster.api.get(
            DEPLOYMENT_URL, params={"labelSelector": selector} if selector else None
        )
        names = sorted(item["metadata"]["name"] for item in (await response.json())["items"])
        assert names == expected, selector


async def test_json_patches_apply_as_writes_and_a_failed_test_is_422(cluster: Cluster) -> None:
    """kopf removes its finalizers with a JSON patch guarded by a ``test`` of the
    resourceVersion: a real server answers a stale one 422 (kopf retries at once on its next
    cycle), and stores a fresh one as any other write."""
    _, created = await post(cluster, DEPLOYMENT_URL, vllm_deployment())
    url = f"{DEPLOYMENT_URL}/llm"
    version = created["metadata"]["resourceVersion"]
    json_patch = {"Content-Type": "application/json-patch+json"}

    def guarded(seen: str, replicas: int) -> list[dict[str, Any]]:
        return [
            {"op": "test", "path": "/metadata/resourceVersion", "value": seen},
            {"op": "replace", "path": "/spec/replicas", "value": replicas},
        ]

    response = await cluster.api.patch(url, json=guarded(version, 3), headers=json_patch)
    assert response.status == 200
    after = await response.json()
    assert after["spec"]["replicas"] == 3 and after["metadata"]["generation"] == 2
    assert after["metadata"]["resourceVersion"] != version
    response = await cluster.api.patch(url, json=guarded(version, 5), headers=json_patch)
    assert response.status == 422 and "does not apply" in (await response.json())["message"]
    stored = cluster.get(DEPLOYMENTS_PATH, "llm")
    assert stored is not None and stored["spec"]["replicas"] == 3
    missing = [{"op": "remove", "path": "/metadata/finalizers/0"}]
    response = await cluster.api.patch(url, json=missing, headers=json_patch)
    assert response.status == 422


async def test_deleting_an_object_with_finalizers_marks_it_as_a_write(cluster: Cluster) -> None:
    """A DELETE of an object with finalizers sets its deletionTimestamp: a write (a new
    resourceVersion, the generation bumped), so a write based on an earlier read is 409;
    the mark is the server's to keep, and it takes no new finalizers."""
    deployment = vllm_deployment()
    deployment["metadata"]["finalizers"] = ["example.com/hold"]
    _, created = await post(cluster, DEPLOYMENT_URL, deployment)
    url = f"{DEPLOYMENT_URL}/llm"
    version = created["metadata"]["resourceVersion"]
    response = await cluster.api.delete(url)
    assert response.status == 200
    marked = cluster.get(DEPLOYMENTS_PATH, "llm")
    assert marked is not None and marked["metadata"]["deletionTimestamp"]
    assert marked["metadata"]["resourceVersion"] != version and marked["metadata"]["generation"] == 2
    status, _ = await patch(cluster, url, {"metadata": {"resourceVersion": version, "labels": {"a": "1"}}})
    assert status == 409
    status, _ = await patch(cluster, url, {"metadata": {"finalizers": ["example.com/hold", "another"]}})
    assert status == 422
    status, after = await patch(cluster, url, {"metadata": {"deletionTimestamp": None}})
    assert status == 200 and after["metadata"]["deletionTimestamp"] == marked["metadata"]["deletionTimestamp"]
    status, _ = await patch(cluster, url, {"metadata": {"finalizers": None}})
    assert status == 200 and cluster.get(DEPLOYMENTS_PATH, "llm") is None


async def test_custom_resources_are_validated_by_the_crd_schema(cluster: Cluster) -> None:
    """Every write of a pool, its status included, is checked against the CRD's schema
    (types, enums, required fields): one that breaks it is 422 and changes nothing."""
    manifest = pool_manifest(spec=pool_spec(imagePullPolicy="Sometimes"))
    response = await cluster.api.post(POOLS.path(NAMESPACE), json=manifest)
    assert response.status == 422 and "imagePullPolicy" in (await response.json())["message"]
    await cluster.create(pool_manifest())
    url = POOLS.path(NAMESPACE, "pool")
    status, body = await patch(cluster, url + "/status", {"status": {"observedGeneration": "one"}})
    assert status == 422 and "observedGeneration" in body["message"]
    scale_down = {"lastScaleDown": {"at": "2025-01-01T00:00:00Z"}}  # fromReplicas, ... required
    status, _ = await patch(cluster, url + "/status", {"status": scale_down})
    assert status == 422
    ready = {"status": {"phase": "Ready", "masterAddress": None}}  # nullable: null is valid
    status, after = await patch(cluster, url + "/status", ready)
    assert status == 200 and after["status"]["phase"] == "Ready"
    stored = cluster.get(POOLS_PATH, "pool")
    assert stored is not None and stored["status"] == {"phase": "Ready"}
