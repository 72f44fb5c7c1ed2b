"""Injection that could do nothing is refused, naming the rule and the fix: a shell launch, a
transfer config of another connector, a ``--kv-cache-dtype`` other than the declared layout's,
a block hash that is not collision resistant where the pool does not allow one, no single vLLM
container."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.operator import names
from kvpool.operator.consumers import (
    KV_CACHE_TORCH_DTYPES,
    ConsumerError,
    Injection,
    injected,
    injection_refusal,
)
from kvpool.operator.plan import build_plan
from testing.kube_api import DEPLOYMENTS_PATH, NAMESPACE, Cluster, eventually
from testing.operator_objects import (
    ORIGINAL_KV_CONFIG,
    Operator,
    consumer,
    kv_flags,
    layout,
    pool_manifest,
    pool_spec,
    vllm_deployment,
)


def injection(container: str | None = "vllm", dtype: str = "bfloat16") -> Injection:
    spec = pool_spec(consumers=[{"name": "llm", "layout": layout(dtype=dtype)}])
    if container is not None:
        spec["consumers"][0]["container"] = container
    return build_plan("pool", NAMESPACE, spec).consumers[0]


def shell_launched(name: str = "llm") -> dict[str, Any]:
    deployment = vllm_deployment(name)
    vllm = deployment["spec"]["template"]["spec"]["containers"][0]
    vllm["command"] = ["sh", "-c", "vllm serve org/model --port 8000"]
    del vllm["args"]
    return deployment


def rule_of(deployment: dict[str, Any], inj: Injection) -> str | None:
    refused = injection_refusal(deployment, inj)
    return None if refused is None else refused.rule


def test_each_rule_names_itself_and_the_fix() -> None:
    assert rule_of(vllm_deployment(), injection()) is None

    refused = injection_refusal(shell_launched(), injection())
    assert refused is not None and refused.rule == "shell-launch"
    assert "$0" in refused.message and '"$@"' in refused.message and "team-a/llm" in refused.message
    bash = shell_launched()
    bash["spec"]["template"]["spec"]["containers"][0].update(
        command=["/bin/bash"], args=["-lc", "exec vllm serve m"]
    )
    assert rule_of(bash, injection()) == "shell-launch"

    refused = injection_refusal(vllm_deployment(kv_config=ORIGINAL_KV_CONFIG), injection())
    assert refused is not None and refused.rule == "kv-config-set"
    assert "remove it from the Deployment" in refused.message
    # The pool's own flag (an earlier injection) is no refusal.
    assert rule_of(injected(vllm_deployment(), injection()), injection()) is None

    fp8 = with_args("--kv-cache-dtype", "fp8")
    refused = injection_refusal(fp8, injection(dtype="float32"))
    assert (
        refused is not None and refused.rule == "kv-cache-dtype" and "layout.dtype: uint8" in refused.message
    )
    assert rule_of(fp8, injection(dtype="uint8")) is None

    # A block hash that is not collision resistant: the connector would refuse to start.
    xxhash = vllm_deployment()
    xxhash["spec"]["template"]["spec"]["containers"][0]["args"] += ["--prefix-caching-hash-algo=xxhash"]
    refused = injection_refusal(xxhash, injection())
    assert refused is not None and refused.rule == "block-hash"
    assert "allow_non_cryptographic_block_hash" in refused.message
    allowing = pool_spec(consumers=[{"name": "llm", "layout": layout(), "container": "vllm"}])
    allowing["connector"]["allow_non_cryptographic_block_hash"] = True
    assert rule_of(xxhash, build_plan("pool", NAMESPACE, allowing).consumers[0]) is None

    two_vllms = vllm_deployment()
    containers = two_vllms["spec"]["template"]["spec"]["containers"]
    containers[1]["image"] = "vllm/vllm-openai:v0.11.0"
    refused = injection_refusal(two_vllms, injection(container=None))
    assert refused is not None and refused.rule == "ambiguous-container"
    assert "spec.consumers[].container" in refused.message
    with pytest.raises(ConsumerError, match="ambiguous-container"):
        injected(two_vllms, injection(container=None))
    # One vLLM container beside a sidecar (listed first): that one, whatever the order.
    containers.reverse()
    containers[0]["image"] = "busybox"
    assert rule_of(two_vllms, injection(container=None)) is None
    chosen = injected(two_vllms, injection(container=None))["spec"]["template"]["spec"]["containers"]
    assert [bool(kv_flags_of(c)) for c in chosen] == [False, True]
    assert rule_of(vllm_deployment(), injection(container="nope")) == "no-container"


def with_args(*args: str) -> dict[str, Any]:
    deployment = vllm_deployment()
    deployment["spec"]["template"]["spec"]["containers"][0]["args"] += list(args)
    return deployment


def test_the_kv_cache_dtype_is_checked_against_the_dtype_vllm_stores() -> None:
    """A layout's dtype is the torch dtype of its groups, as ``kvpool-layout`` prints it
    (``float32`` for a float32 model under ``--kv-cache-dtype auto``, ``uint8`` under ``fp8``:
    printed by vLLM 0.32's probe), never a ``--kv-cache-dtype`` name, which the connector
    never builds."""
    # What kvpool-layout prints for the flags: what the connector accepts, never refused.
    assert rule_of(with_args("--kv-cache-dtype", "auto"), injection(dtype="float32")) is None
    assert rule_of(with_args("--kv-cache-dtype=fp8_e5m2"), injection(dtype="uint8")) is None
    assert rule_of(with_args("--kv_cache_dtype", "bfloat16"), injection(dtype="bfloat16")) is None
    # A hybrid: the Mamba state's own dtype beside the attention groups'.
    assert rule_of(with_args("--kv-cache-dtype", "fp8"), injection(dtype="float32,uint8")) is None
    # A flag's name as the dtype: the connector would stay out of the pool.
    refused = injection_refusal(with_args("--kv-cache-dtype", "fp8"), injection(dtype="fp8"))
    assert refused is not None and refused.rule == "kv-cache-dtype"
    assert "stores as uint8" in refused.message and "layout.dtype: uint8" in refused.message
    # Only Mamba groups: their dtype is not the flag's.
    mamba = pool_spec(
        consumers=[
            {
                "name": "llm",
                "container": "vllm",
                "layout": layout(
                    {"kind": "mamba", "block_size": 16, "mamba_cache_mode": "align"}, dtype="float32"
                ),
            }
        ]
    )
    (only_mamba,) = build_plan("pool", NAMESPACE, mamba).consumers
    assert rule_of(with_args("--kv-cache-dtype", "fp8"), only_mamba) is None


def test_the_stored_dtype_of_each_kv_cache_dtype_is_vllms() -> None:
    """The operator's image has no vLLM, so it keeps its own table of what each
    ``--kv-cache-dtype`` stores: the one vLLM uses, name by name, as the connector's layout
    spells it (the torch dtype without ``torch.``)."""
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    for name, stored in KV_CACHE_TORCH_DTYPES.items():
        assert str(STR_DTYPE_TO_TORCH_DTYPE[name]).removeprefix("torch.") == stored, name


def kv_flags_of(container: dict[str, Any]) -> list[str]:
    return [a for a in container.get("args") or [] if a.startswith("--kv-transfer-config")]


@pytest.mark.asyncio
async def test_refused_consumers_are_named_and_never_written(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(shell_launched("shell"))
    await cluster.create(vllm_deployment("lmcache", kv_config=ORIGINAL_KV_CONFIG))
    await cluster.create(vllm_deployment("llm"))
    consumers = [consumer("shell"), consumer("lmcache"), consumer("llm")]
    await cluster.create(pool_manifest(spec=pool_spec(consumers=consumers)))

    def refusals() -> str | None:
        message = cluster.condition("pool", "Conflict").get("message", "")
        return message if "[shell-launch]" in message and "[kv-config-set]" in message else None

    message = await eventually(refusals, what="both refusals named")
    assert "team-a/shell" in message and "team-a/lmcache" in message
    events = await eventually(
        lambda: len(cluster.events("ConsumerRefused")) == 2 and cluster.events("ConsumerRefused")
    )
    assert {e["type"] for e in events} == {"Warning"}
    await eventually(
        lambda: cluster.settle() or kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm")),
        what="the other consumer injected",
    )
    cluster.settle()
    await cluster.passes("pool", cluster.mark(), count=2)
    status = cluster.pool_status("pool")
    rollout = cluster.condition("pool", "ConsumersRolledOut")
    assert rollout["status"] == "False" and "shell" in rollout["message"] and "lmcache" in rollout["message"]
    assert [c["rolledOut"] for c in status["consumers"]] == [False, False, True]
    for refused in ("shell", "lmcache"):
        path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{refused}"
        assert [r for r in cluster.writes() if r.url.path == path] == []
    assert names.LABEL_CONSUMER_OF not in cluster.get(DEPLOYMENTS_PATH, "shell")["metadata"]["labels"]


def test_a_refusal_never_splits_the_conflict_condition() -> None:
    from kvpool.operator.consumers import Refusal

    assert "; " not in str(Refusal("rule", "first; second"))
