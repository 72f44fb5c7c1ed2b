"""The real operator (kopf, handlers, client) against kmock over HTTP on 127.0.0.1.

Assertions are on the objects kmock holds and on the requests it recorded.
"""

from __future__ import annotations

import kmock
import pytest

from kvpool.operator import names
from kvpool.operator.consumers import FLAG, injected
from kvpool.operator.plan import build_plan
from testing.kube_api import (
    DEPLOYMENTS_PATH,
    NAMESPACE,
    POOLS_PATH,
    Cluster,
    eventually,
)
from testing.operator_objects import (
    Operator,
    as_created,
    converge,
    full_group,
    kv_flags,
    layout,
    path_of,
    pool_manifest,
    pool_spec,
    stored,
    template,
    vllm_deployment,
)

pytestmark = pytest.mark.asyncio


async def test_a_pool_comes_up_owned_and_stays_quiet(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(vllm_deployment())
    pool = await cluster.create(pool_manifest())
    status = await converge(cluster, generation=1)

    plan = build_plan("pool", NAMESPACE, pool_spec())
    assert {c["kind"] for c in plan.children} == {
        "ConfigMap",
        "Deployment",
        "Service",
        "NetworkPolicy",
        "PodDisruptionBudget",
    }
    for child in plan.children:
        live = cluster.get(path_of(child), child["metadata"]["name"])
        assert live is not None, child["metadata"]["name"]
        assert kmock.Object(live) >= stored(child)  # everything desired, as built
        (owner,) = live["metadata"]["ownerReferences"]
        assert owner["uid"] == pool["metadata"]["uid"]
        assert owner["kind"] == "MooncakeKVPool" and owner["controller"] is True
    configmap = cluster.get("v1/configmaps", "pool-connector")
    assert configmap is not None and configmap["data"] == plan.children[0]["data"]

    # The consumer: exactly the pure injection of what was created, nothing else.
    injection = plan.consumers[0]
    consumer = cluster.get(DEPLOYMENTS_PATH, "llm")
    expected = stored(injected(as_created(cluster, "llm"), injection))
    assert template(consumer) == template(expected)
    assert kv_flags(consumer) == [f"{FLAG}={injection.kv_transfer_config}"]
    assert template(consumer)["metadata"]["annotations"][names.ANNOTATION_CONFIG_HASH] == (
        injection.config_hash
    )

    assert status["observedGeneration"] == 1
    assert status["masterAddress"] == "pool-master.team-a.svc:50051"
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "ConfigValid": "True",
        "MasterReady": "True",
        "StoreReady": "True",
        "ConsumersRolledOut": "True",
        "Conflict": "False",
        # The operator's pods are not known to it here: the master is not asked.
        "Observed": "Unknown",
        "Degraded": "Unknown",
    }
    assert status["phase"] == "Ready" and "capacity" not in status
    assert status["consumers"] == [
        {
            "name": "llm",
            "configHash": injection.config_hash,
            "layoutFingerprint": injection.layout_fingerprint,
            "rolledOut": True,
            "message": "2/2 replicas updated and available",
        }
    ]
    assert cluster.events("ConsumerUpdated")[0]["involvedObject"]["name"] == "pool"

    # Level-based: more passes over a converged pool write nothing.
    start = cluster.mark()
    end = await cluster.passes("pool", start, count=3)
    assert cluster.writes(start, end) == []


async def test_a_changed_hash_rolls_the_consumer_and_an_unchanged_one_does_not(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest())
    await converge(cluster, generation=1)
    before = cluster.get(DEPLOYMENTS_PATH, "llm")
    old_hash = template(before)["metadata"]["annotations"][names.ANNOTATION_CONFIG_HASH]

    # A master-only change: the master is patched, the consumer's hash is the same.
    start = cluster.mark()
    await cluster.patch_pool("pool", {"spec": {"master": {"leaseTtlMs": 9000}}})
    await converge(cluster, generation=2)
    master = cluster.get(DEPLOYMENTS_PATH, "pool-master")
    assert "--default_kv_lease_ttl=9000" in template(master)["spec"]["containers"][0]["args"]
    end = await cluster.passes("pool", cluster.mark(), count=1)
    patched = {r.url.path for r in cluster.writes(start, end) if r.method.upper() == "PATCH"}
    assert "/apis/apps/v1/namespaces/team-a/deployments/pool-master" in patched
    assert "/apis/apps/v1/namespaces/team-a/deployments/llm" not in patched
    assert cluster.get(DEPLOYMENTS_PATH, "llm") == before

    # A connector change: new settings, new hash, a rollout (not done until it is).
    await cluster.patch_pool("pool", {"spec": {"connector": {"cache_prefix": "team-b"}}})
    plan = build_plan(
        "pool", NAMESPACE, pool_spec(connector={"cache_prefix": "team-b"}, master={"leaseTtlMs": 9000})
    )
    new_hash = plan.consumers[0].config_hash
    assert new_hash != old_hash
    rolling = await eventually(
        lambda: (
            cluster.condition("pool", "ConsumersRolledOut").get("reason") == "RollingOut"
            and cluster.pool_status("pool")
        ),
        what="the consumer is rolling out",
    )
    assert rolling["consumers"][0]["configHash"] == new_hash
    assert rolling["consumers"][0]["rolledOut"] is False
    consumer = cluster.get(DEPLOYMENTS_PATH, "llm")
    assert template(consumer)["metadata"]["annotations"][names.ANNOTATION_CONFIG_HASH] == new_hash
    assert kv_flags(consumer) == [f"{FLAG}={plan.consumers[0].kv_transfer_config}"]
    assert '"cache_prefix":"team-b"' in kv_flags(consumer)[0]
    configmap = cluster.get("v1/configmaps", "pool-connector")
    assert (
        configmap is not None
        and '"cache_prefix":"team-b"' in configmap["data"][names.KV_TRANSFER_CONFIG_FILE]
    )
    status = await converge(cluster, generation=3)
    assert status["consumers"][0]["rolledOut"] is True


async def test_an_invalid_layout_changes_nothing_but_the_status(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(vllm_deployment())
    bad = pool_spec()
    bad["consumers"][0]["layout"]["groups"].append({"kind": "cross", "block_size": 16})
    await cluster.create(pool_manifest(spec=bad))

    condition = await eventually(
        lambda: (
            cluster.condition("pool", "ConfigValid").get("status") == "False"
            and cluster.condition("pool", "ConfigValid")
        ),
        what="ConfigValid=False",
    )
    assert condition["reason"] == "InvalidLayout"
    message = condition["message"]
    assert "spec.consumers[0].layout.groups[2].kind" in message
    assert "consumer 'llm'" in message and "group 2" in message
    assert "[cross-attention]" in message
    assert cluster.pool_status("pool")["phase"] == "Invalid"
    (event,) = await eventually(lambda: cluster.events("InvalidLayout"), what="an Event")
    assert event["type"] == "Warning" and event["message"] == message
    assert event["involvedObject"]["name"] == "pool"

    # Nothing created, the consumer never touched; further passes write nothing.
    await eventually(lambda: cluster.handled("pool"), what="kopf is done with the pool")
    start = cluster.mark()
    end = await cluster.passes("pool", start, count=2)
    assert cluster.writes(start, end) == []
    for path, name in (
        ("v1/configmaps", "pool-connector"),
        (DEPLOYMENTS_PATH, "pool-master"),
        (DEPLOYMENTS_PATH, "pool-store"),
        ("v1/services", "pool-master"),
    ):
        assert cluster.get(path, name) is None
    assert len(cluster.history(DEPLOYMENTS_PATH, "llm")) == 1
    assert not [r for r in cluster.writes() if r.resource and r.resource.plural == "deployments"]

    # Fixed: it converges, and says so.
    fixed = pool_spec()["consumers"]
    await cluster.patch_pool("pool", {"spec": {"consumers": fixed}})
    await converge(cluster, generation=2)
    assert len(kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm"))) == 1
    assert cluster.events("ConfigValid")


async def test_deleting_the_pool_removes_children_and_restores_consumers(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create(vllm_deployment("llm"))
    await cluster.create(vllm_deployment("chat"))
    consumers = [
        {"name": "llm", "container": "vllm", "layout": layout(full_group())},
        {"name": "chat", "container": "vllm", "layout": layout(full_group(32))},
    ]
    await cluster.create(pool_manifest(spec=pool_spec(consumers=consumers)))
    await converge(cluster, generation=1)
    assert all(len(kv_flags(cluster.get(DEPLOYMENTS_PATH, n))) == 1 for n in ("llm", "chat"))

    # A consumer dropped from the spec gets its own settings back.
    await cluster.patch_pool("pool", {"spec": {"consumers": consumers[:1]}})
    await eventually(
        lambda: template(cluster.get(DEPLOYMENTS_PATH, "chat")) == template(as_created(cluster, "chat")),
        what="chat restored",
    )
    chat = cluster.get(DEPLOYMENTS_PATH, "chat")
    assert chat is not None
    assert chat["metadata"]["labels"] == as_created(cluster, "chat")["metadata"]["labels"]
    assert "annotations" not in chat["metadata"]

    await cluster.delete_pool("pool")
    await eventually(lambda: cluster.get(POOLS_PATH, "pool") is None, what="pool gone")
    for path, name in (
        ("v1/configmaps", "pool-connector"),
        (DEPLOYMENTS_PATH, "pool-master"),
        (DEPLOYMENTS_PATH, "pool-store"),
        ("v1/services", "pool-master"),
        ("networking.k8s.io/v1/networkpolicies", "pool-kvpool"),
    ):
        assert cluster.get(path, name) is None, name
    llm = cluster.get(DEPLOYMENTS_PATH, "llm")
    original = as_created(cluster, "llm")
    assert template(llm) == template(original)
    assert llm is not None and llm["metadata"]["labels"] == original["metadata"]["labels"]
    assert "annotations" not in llm["metadata"]
