"""The emulated API refuses what a real API server refuses: a write that changes an immutable
field, or leaves an object its validation rejects, is 422 Invalid with the field named in
``details.causes``, and changes nothing."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from testing.kube_api import NAMESPACE, Cluster, emulated_cluster

pytestmark = pytest.mark.asyncio
MERGE = {"Content-Type": "application/merge-patch+json"}
SELECTOR = {"matchLabels": {"app": "web"}}


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async with emulated_cluster() as cluster:
        yield cluster


def deployment(name: str = "web", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "selector": copy.deepcopy(SELECTOR),
            "template": {
                "metadata": {"labels": {"app": "web", "tier": "front"}},
                "spec": {"containers": [{"name": "web", "image": "web:1"}]},
            },
            **spec,
        },
    }


def url(kind: str, name: str | None = None) -> str:
    base = {
        "Deployment": f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments",
        "Service": f"/api/v1/namespaces/{NAMESPACE}/services",
        "ConfigMap": f"/api/v1/namespaces/{NAMESPACE}/configmaps",
        "Job": f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs",
    }[kind]
    return f"{base}/{name}" if name else base


async def create(cluster: Cluster, obj: dict[str, Any]) -> dict[str, Any]:
    response = await cluster.api.post(url(obj["kind"]), json=obj)
    assert response.status in (200, 201), await response.text()
    return dict(await response.json())


async def refused(cluster: Cluster, kind: str, name: str, patch: dict[str, Any]) -> list[str]:
    """The fields a 422 names for ``patch``; asserts the stored object did not change."""
    before = (await (await cluster.api.get(url(kind, name))).json())["metadata"]["resourceVersion"]
    response = await cluster.api.patch(url(kind, name), json=patch, headers=MERGE)
    body = await response.json()
    assert response.status == 422, body
    assert (body["kind"], body["reason"]) == ("Status", "Invalid")
    after = (await (await cluster.api.get(url(kind, name))).json())["metadata"]["resourceVersion"]
    assert after == before
    return [c["field"] for c in body["details"]["causes"]]


async def accepted(cluster: Cluster, kind: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
    response = await cluster.api.patch(url(kind, name), json=patch, headers=MERGE)
    assert response.status == 200, await response.text()
    return dict(await response.json())


async def test_a_workloads_selector_is_immutable(cluster: Cluster) -> None:
    await create(cluster, deployment())
    changed = {"spec": {"selector": {"matchLabels": {"app": "web", "tier": "front"}}}}
    assert await refused(cluster, "Deployment", "web", changed) == ["spec.selector"]
    # The rest of the spec, template labels the selector still matches included, may change.
    await accepted(cluster, "Deployment", "web", {"spec": {"replicas": 3, "template": {"metadata": {}}}})


async def test_a_selector_must_match_the_template_and_recreate_takes_no_rolling_update(
    cluster: Cluster,
) -> None:
    elsewhere = deployment(selector={"matchLabels": {"app": "db"}})
    response = await cluster.api.post(url("Deployment"), json=elsewhere)
    assert response.status == 422
    assert [c["field"] for c in (await response.json())["details"]["causes"]] == [
        "spec.template.metadata.labels"
    ]
    await create(cluster, deployment())  # the server defaults a RollingUpdate strategy
    assert await refused(cluster, "Deployment", "web", {"spec": {"strategy": {"type": "Recreate"}}}) == [
        "spec.strategy.rollingUpdate"
    ]
    patch = {"spec": {"strategy": {"type": "Recreate", "rollingUpdate": None}}}
    assert (await accepted(cluster, "Deployment", "web", patch))["spec"]["strategy"] == {"type": "Recreate"}


async def test_a_services_cluster_ip_may_not_change_once_set(cluster: Cluster) -> None:
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": NAMESPACE},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]},
    }
    allocated = (await create(cluster, service))["spec"]["clusterIP"]
    assert sorted(await refused(cluster, "Service", "web", {"spec": {"clusterIP": "None"}})) == [
        "spec.clusterIP"
    ]
    # A write that leaves it out (or clears it) keeps the allocated one.
    kept = await accepted(cluster, "Service", "web", {"spec": {"clusterIP": None, "clusterIPs": None}})
    assert (kept["spec"]["clusterIP"], kept["spec"]["clusterIPs"]) == (allocated, [allocated])


async def test_a_jobs_template_and_an_immutable_config_maps_data_are_fixed(cluster: Cluster) -> None:
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "once", "namespace": NAMESPACE},
        "spec": {
            "template": {
                "spec": {"restartPolicy": "Never", "containers": [{"name": "once", "image": "once:1"}]}
            }
        },
    }
    await create(cluster, job)
    image = {"spec": {"template": {"spec": {"containers": [{"name": "once", "image": "once:2"}]}}}}
    assert await refused(cluster, "Job", "once", image) == ["spec.template"]
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "fixed", "namespace": NAMESPACE},
        "data": {"a": "1"},
        "immutable": True,
    }
    await create(cluster, config)
    assert await refused(cluster, "ConfigMap", "fixed", {"data": {"a": "2"}}) == ["data"]
    await accepted(cluster, "ConfigMap", "fixed", {"metadata": {"labels": {"x": "y"}}})
