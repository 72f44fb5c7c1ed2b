"""An operator upgrade changes nothing that serves unless the change matters to it; a paused
pool is neither applied, rolled nor patched."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import create_model

from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.operator import connector_settings, names, plan
from kvpool.operator.app import OperatorOptions
from testing.kube_api import (
    DEPLOYMENTS_PATH,
    NAMESPACE,
    Cluster,
    eventually,
    quick_options,
    running_operator,
    write_kubeconfig,
)
from testing.operator_objects import (
    Operator,
    converge,
    kv_flags,
    pool_manifest,
    pool_spec,
    template,
    vllm_deployment,
)

pytestmark = pytest.mark.asyncio

# A later release of the contract: one more setting, with its default.
NewerSettings = create_model(
    "ConnectorSettings",
    __base__=ConnectorSettings,
    prefetch_depth=(int, 4),
)


def with_server_defaults(build: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """A later release that renders the master with fields the API server defaults the same way."""

    def build_newer(*args: Any, **kwargs: Any) -> dict[str, Any]:
        deployment = build(*args, **kwargs)
        deployment["spec"].update(revisionHistoryLimit=10, progressDeadlineSeconds=600)
        deployment["spec"]["template"]["spec"]["containers"][0]["terminationMessagePolicy"] = "File"
        return deployment

    return build_newer


def options(cluster: Cluster, tmp_path: Path, name: str) -> OperatorOptions:
    return OperatorOptions(**quick_options(write_kubeconfig(tmp_path / name, cluster.url)))


def writes_to_children(cluster: Cluster, start: int) -> list[str]:
    """The operator's writes since ``start`` to anything but the pool itself and Events."""
    return [
        f"{r.method} {r.url.path}"
        for r in cluster.writes(start)
        if r.resource is not None and r.resource.plural not in ("mooncakekvpools", "events")
    ]


async def test_an_upgrade_that_adds_a_default_setting_patches_nothing(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest())
    async with running_operator(cluster, options(cluster, tmp_path, "old")):
        await converge(cluster, generation=1)
        await cluster.quiet("pool")
    before = {name: cluster.get(DEPLOYMENTS_PATH, name) for name in ("llm", "pool-master", "pool-store")}

    # The new release: a new connector setting (with its default), a master rendered with
    # fields the server already holds.
    monkeypatch.setattr(connector_settings, "ConnectorSettings", NewerSettings)
    monkeypatch.setattr(plan, "master_deployment", with_server_defaults(plan.master_deployment))
    start = cluster.mark()
    async with running_operator(cluster, options(cluster, tmp_path, "new")):
        await cluster.passes("pool", start, count=3)
        assert writes_to_children(cluster, start) == []
        for name, deployment in before.items():
            assert cluster.get(DEPLOYMENTS_PATH, name) == deployment, name
        assert cluster.pool_status("pool")["phase"] == "Ready"

        # A setting that matters (not its default) still rolls the consumer.
        await cluster.patch_pool("pool", {"spec": {"connector": {"cache_prefix": "team-b"}}})
        await eventually(
            lambda: '"cache_prefix":"team-b"' in kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm"))[0]
        )
        assert "prefetch_depth" not in kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm"))[0]
        await converge(cluster, generation=2)


async def test_a_paused_pool_is_left_as_it_is(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest())
    ready = await converge(cluster, generation=1)
    await cluster.patch_pool("pool", {"metadata": {"annotations": {names.ANNOTATION_PAUSED: "true"}}})
    await eventually(lambda: cluster.pool_status("pool").get("phase") == "Paused", what="phase Paused")
    paused = cluster.condition("pool", "Paused")
    assert paused["status"] == "True" and names.ANNOTATION_PAUSED in paused["message"]
    await eventually(lambda: cluster.events("Paused"), what="a Paused Event")

    # A spec change and a hand edit while paused: nothing is applied, rolled or put back.
    llm = cluster.get(DEPLOYMENTS_PATH, "llm")
    start = cluster.mark()
    await cluster.patch_pool(
        "pool", {"spec": {"connector": {"cache_prefix": "team-b"}, "master": {"leaseTtlMs": 9000}}}
    )
    response = await cluster.api.patch(
        f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/pool-store",
        json={"spec": {"replicas": 0}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert response.status == 200
    await cluster.passes("pool", cluster.mark(), count=3)
    assert writes_to_children(cluster, start) == []
    assert template(cluster.get(DEPLOYMENTS_PATH, "llm")) == template(llm)
    status = cluster.pool_status("pool")
    assert status["observedGeneration"] == ready["observedGeneration"] == 1
    assert status["phase"] == "Paused"

    # Resumed: the pool converges to its current spec.
    await cluster.patch_pool("pool", {"metadata": {"annotations": {names.ANNOTATION_PAUSED: None}}})
    status = await converge(cluster, generation=2)
    assert "Paused" not in {c["type"] for c in status["conditions"]}
    assert '"cache_prefix":"team-b"' in kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm"))[0]
    assert cluster.get(DEPLOYMENTS_PATH, "pool-store")["spec"]["replicas"] == 2
    await eventually(lambda: cluster.events("Resumed"), what="a Resumed Event")


# What every release selects its children's pods by. A Deployment's ``spec.selector`` is
# immutable (a real API server answers 422 to a patch of it), so a release that selected by
# anything else could never apply any pool an earlier release made: never change these.
PINNED_SELECTORS = {
    ("Deployment", "pool-master"): {
        "kvpool.mooncake.io/pool": "pool",
        "kvpool.mooncake.io/component": "master",
    },
    ("Deployment", "pool-store"): {
        "kvpool.mooncake.io/pool": "pool",
        "kvpool.mooncake.io/component": "store",
    },
}
HA_MASTER = {"replicas": 2, "ha": {"enabled": True, "etcdEndpoints": ["etcd:2379"]}}


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"master": HA_MASTER},
        {"store": {"segmentSize": "1GB", "replicas": 2, "diskTier": {"capacity": "1GB"}}},
        {"store": {"segmentSize": "1GB", "replicas": 2, "drainTimeoutSeconds": 0}},
        {"tenancy": {"enabled": True}, "consumers": []},
    ],
    ids=["single master", "HA", "disk tier", "no drains", "tenancy"],
)
async def test_the_pod_selectors_are_those_of_every_release(overrides: dict[str, Any]) -> None:
    built = plan.build_plan("pool", NAMESPACE, pool_spec(**overrides))
    assert built.valid, built.problems
    selectors = {
        (c["kind"], c["metadata"]["name"]): c["spec"]["selector"]["matchLabels"]
        for c in built.children
        if c["kind"] == "Deployment"
    }
    assert selectors == PINNED_SELECTORS
    for child in built.children:  # each pod template carries its own selector's labels
        if child["kind"] == "Deployment":
            assert selectors[child["kind"], child["metadata"]["name"]].items() <= (
                child["spec"]["template"]["metadata"]["labels"].items()
            )
