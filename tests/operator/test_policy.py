"""The admin's policy (registries with path boundaries, replica caps, priority classes,
tolerations and node selectors, the NetworkPolicy opt-out) and warnings, end to end: a
refused pool gets ConfigValid=False and an Event naming the field and rule, and nothing is
written; a warned-about pool runs, and says so once."""

from __future__ import annotations

import pytest

from kvpool.operator.plan import build_plan
from kvpool.operator.policy import CONTROL_PLANE_KEYS, OperatorPolicy, registry_allows
from testing.kube_api import Cluster, eventually
from testing.operator_objects import Operator, converge, pool_manifest, pool_spec, vllm_deployment
from tests.operator.test_operator_endpoints import admit

POLICY = OperatorPolicy(allowed_registries=("registry.internal",), max_store_replicas=2)
RDMA = {"segmentSize": "1GB", "protocol": "rdma", "rdmaDevices": ["mlx5_0"]}


@pytest.mark.parametrize("operator_config", [{"policy": POLICY}])
@pytest.mark.asyncio
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
    assert "spec.image: image 'registry.example/mooncake:0.3.13' comes from none of the allowed" in message
    assert "[image-registry]" in message
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


@pytest.mark.asyncio
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
@pytest.mark.asyncio
async def test_the_webhook_applies_the_policy_and_warns(cluster: Cluster, operator: Operator) -> None:
    assert operator.webhook_url is not None
    url = f"{operator.webhook_url}/validate-pool"
    refused = await admit(url, pool_spec())
    assert refused["allowed"] is False and "[image-registry]" in refused["status"]["message"]
    warned = await admit(url, pool_spec(image="registry.internal/mooncake:1", store=RDMA))
    assert warned["allowed"] is True
    (warning,) = warned["warnings"]
    assert "IPC_LOCK" in warning and "[pod-security-restricted]" in warning


@pytest.mark.parametrize(
    ("entry", "image", "admitted"),
    [
        ("registry.internal", "registry.internal/x", True),
        ("registry.internal", "registry.internal/team/mooncake:1", True),
        ("registry.internal", "registry.internal/x@sha256:" + "a" * 64, True),
        ("registry.internal", "registry.internal.evil.com/x", False),
        ("registry.internal", "registry.internal:5000/x", False),
        ("registry.internal", "evil.com/registry.internal/x", False),
        ("registry.internal", "registry.internalx/x", False),
        ("registry.internal:5000", "registry.internal:5000/x", True),
        ("registry.internal:5000", "registry.internal/x", False),
        ("registry.internal/mooncake", "registry.internal/mooncake:1", True),
        ("registry.internal/mooncake", "registry.internal/mooncake/store:1", True),
        ("registry.internal/mooncake", "registry.internal/mooncake-evil:1", False),
        ("registry.internal/mooncake", "registry.internal/x/../mooncake/store:1", False),
        ("docker.io/library", "mooncake-store:0.1.0", True),
        ("docker.io", "someone/mooncake:1", True),
        ("registry.internal", "mooncake-store:0.1.0", False),
        ("localhost:5000", "localhost:5000/m:1", True),
    ],
)
def test_registries_have_path_boundaries(entry: str, image: str, admitted: bool) -> None:
    assert registry_allows(entry, image) is admitted


def test_a_registry_entry_must_be_a_registry() -> None:
    for bad in (
        "registry.internal/x:1",
        "https://registry.internal",
        "",
        "registry.internal/X",
        "registry.internal\n",
        "registry.internal/team\n",
    ):
        with pytest.raises(ValueError, match="is not a registry"):
            OperatorPolicy(allowed_registries=(bad,))


def problems(raw: dict, policy: OperatorPolicy | None = None) -> set[tuple[str, str]]:
    return {(p.field, p.rule) for p in build_plan("pool", "team-a", raw, policy).problems}


CONTROL_PLANE = {"key": CONTROL_PLANE_KEYS[0], "operator": "Exists", "effect": "NoSchedule"}


@pytest.mark.parametrize(
    ("master", "expected"),
    [
        (
            {"priorityClassName": "system-cluster-critical"},
            ("spec.master.priorityClassName", "priority-class"),
        ),
        ({"priorityClassName": "system-node-critical"}, ("spec.master.priorityClassName", "priority-class")),
        ({"tolerations": [CONTROL_PLANE]}, ("spec.master.tolerations[0].key", "toleration-protected")),
        (
            {"tolerations": [{"key": "node-role.kubernetes.io/master", "operator": "Exists"}]},
            ("spec.master.tolerations[0].key", "toleration-protected"),
        ),
        (
            {"tolerations": [{"operator": "Exists"}]},
            ("spec.master.tolerations[0].key", "toleration-protected"),
        ),
        (
            {"nodeSelector": {"node-role.kubernetes.io/control-plane": ""}},
            ("spec.master.nodeSelector", "node-selector-protected"),
        ),
    ],
)
def test_the_default_policy_keeps_pools_off_the_control_plane(master: dict, expected: tuple) -> None:
    assert problems(pool_spec(master=master)) == {expected}


def test_the_default_policy_keeps_the_network_policy_on() -> None:
    raw = pool_spec(networkPolicy={"enabled": False})
    assert problems(raw) == {("spec.networkPolicy.enabled", "network-policy-required")}
    assert problems(raw, OperatorPolicy(allow_network_policy_opt_out=True)) == set()


def test_listed_priority_classes_and_toleration_keys_only() -> None:
    policy = OperatorPolicy(
        allowed_priority_classes=("kv-cache",),
        allowed_toleration_keys=("nvidia.com/gpu",),
        protected_node_keys=("example.com/infra",),
    )
    fine = {"priorityClassName": "kv-cache", "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]}
    assert problems(pool_spec(store={"segmentSize": "1GB", **fine}), policy) == set()
    raw = pool_spec(
        store={
            "segmentSize": "1GB",
            "priorityClassName": "high",
            "tolerations": [{"key": "spot", "operator": "Exists"}, {"key": "example.com/infra"}],
            "nodeSelector": {"example.com/infra": "yes"},
        }
    )
    assert problems(raw, policy) == {
        ("spec.store.priorityClassName", "priority-class"),
        ("spec.store.tolerations[0].key", "toleration-allowlist"),
        ("spec.store.tolerations[1].key", "toleration-protected"),
        ("spec.store.nodeSelector", "node-selector-protected"),
    }


@pytest.mark.asyncio
async def test_a_pool_on_the_control_plane_is_refused_and_nothing_written(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create(vllm_deployment())
    spec = pool_spec(store={"segmentSize": "1GB", "tolerations": [CONTROL_PLANE]})
    await cluster.create(pool_manifest(spec=spec))
    condition = await eventually(
        lambda: (
            cluster.condition("pool", "ConfigValid").get("status") == "False"
            and cluster.condition("pool", "ConfigValid")
        )
    )
    assert condition["message"] == (
        "spec.store.tolerations[0].key: taint 'node-role.kubernetes.io/control-plane' marks nodes "
        "pools may not run on [toleration-protected]"
    )
    await eventually(lambda: cluster.handled("pool"), what="kopf is done with the pool")
    written = [r for r in cluster.writes() if r.resource is not None and r.resource.plural != "events"]
    assert {r.resource.plural for r in written} <= {"mooncakekvpools"}


def test_the_crd_keeps_pools_off_the_control_plane_too() -> None:
    """What no policy may allow is also refused by the API server: CEL rules in the CRD,
    generated from the spec models, with bounds that keep their cost estimate small."""
    from kvpool.operator.crd import build_crd

    spec = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for component in ("master", "store"):
        props = spec["properties"][component]["properties"]
        (selector,) = props["nodeSelector"]["x-kubernetes-validations"]
        assert all(f"!('{key}' in self)" in selector["rule"] for key in CONTROL_PLANE_KEYS)
        assert props["nodeSelector"]["maxProperties"] == 64
        (priority,) = props["priorityClassName"]["x-kubernetes-validations"]
        assert (
            priority["rule"] == "!self.startsWith('system-')"
            and props["priorityClassName"]["maxLength"] == 253
        )
        tolerations = props["tolerations"]
        assert tolerations["maxItems"] == 64 and tolerations["items"]["properties"]["key"]["maxLength"] == 317
        protected, keyless = tolerations["items"]["x-kubernetes-validations"]
        assert all(f"'{key}'" in protected["rule"] for key in CONTROL_PLANE_KEYS)
        assert "self.operator != 'Exists'" in keyless["rule"]
    # The API server refuses master and store ports in the transfer range, as the operator does.
    ports = [spec["properties"]["master"]["properties"][p] for p in ("rpcPort", "metricsPort")]
    ports.append(spec["properties"]["store"]["properties"]["port"])
    for port in ports:
        (outside,) = port["x-kubernetes-validations"]
        assert outside["rule"] == "self < 15000 || self > 17000"
