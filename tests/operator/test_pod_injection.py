"""Injection at Pod admission, the pure part: a new consumer Pod gets exactly what Deployment
patching would give its template, a record of it, or a refusal naming the rule and the fix;
the Deployment side is one restart annotation."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from kvpool.operator import names
from kvpool.operator.consumers import Injection, Refusal, injected, injection_refusal
from kvpool.operator.merge_patch import apply_merge_patch
from kvpool.operator.plan import build_plan
from kvpool.operator.pod_injection import (
    PodInjection,
    admit_pod,
    owning_deployment,
    pod_config_hashes,
    restart_patch,
    template_refusal,
)
from testing.kube_api import NAMESPACE
from testing.operator_objects import pool_spec, vllm_deployment
from testing.pod_admission import replica_set_pod, serving_pool


def opted_in(name: str = "llm", pool: str = "pool") -> dict[str, Any]:
    """A vLLM Deployment whose pod template carries the opt-in label (pod-admission consent)."""
    deployment = vllm_deployment(name, allow_pool=None)
    deployment["spec"]["template"]["metadata"]["labels"][names.LABEL_ALLOW_POOL] = pool
    return deployment


def the_injection(spec: dict[str, Any] | None = None) -> Injection:
    return build_plan("pool", NAMESPACE, spec or pool_spec()).consumers[0]


def admit(pod: dict[str, Any], pool: dict[str, Any] | None = None) -> PodInjection:
    answer = admit_pod(pod, NAMESPACE, serving_pool() if pool is None else pool)
    assert isinstance(answer, PodInjection), answer
    return answer


def refused(pod: dict[str, Any], pool: dict[str, Any] | None) -> Refusal:
    answer = admit_pod(pod, NAMESPACE, pool)
    assert isinstance(answer, Refusal), answer
    return answer


def test_the_injected_pod_is_what_deployment_patching_gives_its_template() -> None:
    deployment = opted_in()
    pod = replica_set_pod(deployment)
    answer = admit(pod)
    pod_after = apply_merge_patch(pod, answer.patch)

    template = injected(deployment, the_injection())["spec"]["template"]
    assert pod_after["spec"] == template["spec"]
    labels = pod_after["metadata"]["labels"]
    assert labels == {
        **template["metadata"]["labels"],
        "pod-template-hash": pod["metadata"]["labels"]["pod-template-hash"],
    }
    assert labels[names.LABEL_POOL] == "pool"  # the pool's NetworkPolicies select it
    annotations = pod_after["metadata"]["annotations"]
    assert annotations[names.ANNOTATION_CONFIG_HASH] == the_injection().config_hash
    # Only the Pod's own fields moved: name, owner and the other container are as they were.
    for key in ("generateName", "ownerReferences", "namespace"):
        assert pod_after["metadata"][key] == pod["metadata"][key]
    assert pod_after["spec"]["containers"][1] == pod["spec"]["containers"][1]


def test_the_record_on_the_pod_says_what_was_injected() -> None:
    answer = admit(replica_set_pod(opted_in()))
    injection = the_injection()
    raw = apply_merge_patch(replica_set_pod(opted_in()), answer.patch)["metadata"]["annotations"][
        names.ANNOTATION_INJECTED
    ]
    record = json.loads(raw)
    assert record == answer.record
    assert record["pool"] == "pool" and record["deployment"] == "llm" and record["container"] == "vllm"
    assert record["configHash"] == injection.config_hash
    assert record["layoutFingerprint"] == injection.layout_fingerprint
    assert record["args"] == [f"--kv-transfer-config={injection.kv_transfer_config}"]
    assert record["volume"] == {"name": names.CONNECTOR_VOLUME, "configMap": "pool-connector"}
    assert set(record["env"]) >= {"PYTHONHASHSEED"}


def test_a_pod_already_injected_is_left_alone() -> None:
    pod = replica_set_pod(opted_in())
    once = apply_merge_patch(pod, admit(pod).patch)
    again = admit(once)
    assert again.patch == {}
    assert again.record == admit(pod).record


def test_the_pods_deployment_is_its_replica_sets_owner() -> None:
    pod = replica_set_pod(opted_in("llm-a"), template_hash="abc12")
    assert owning_deployment(pod) == "llm-a"
    bare = copy.deepcopy(pod)
    del bare["metadata"]["ownerReferences"]
    assert owning_deployment(bare) is None
    job = copy.deepcopy(pod)
    job["metadata"]["ownerReferences"][0].update(kind="Job", apiVersion="batch/v1")
    assert owning_deployment(job) is None
    refusal = refused(bare, serving_pool())
    assert refusal.rule == "no-deployment" and "remove the label" in refusal.message


def not_ready(kind: str) -> dict[str, Any]:
    pool = serving_pool()
    for item in pool["status"]["conditions"]:
        if item["type"] == kind:
            item.update(status="False", message="0/1 available")
    return pool


@pytest.mark.parametrize(
    ("pool", "rule", "fix"),
    [
        (None, "no-pool", "create the pool, or remove the label"),
        (not_ready("MasterReady"), "pool-not-ready", "the ReplicaSet controller retries"),
        (not_ready("StoreReady"), "pool-not-ready", "StoreReady=False: 0/1 available"),
        (
            serving_pool(generation=2) | {"status": {"observedGeneration": 1}},
            "pool-not-ready",
            "generation 2",
        ),
        (
            serving_pool() | {"metadata": {"name": "pool", "deletionTimestamp": "2024-01-01T00:00:00Z"}},
            "pool-deleting",
            "remove the label",
        ),
    ],
)
def test_a_pool_that_cannot_serve_refuses_the_pod_naming_rule_and_fix(
    pool: dict[str, Any] | None, rule: str, fix: str
) -> None:
    refusal = refused(replica_set_pod(opted_in()), pool)
    assert refusal.rule == rule and fix in refusal.message
    assert f"[{rule}]" in str(refusal) and f"Deployment {NAMESPACE}/llm" in str(refusal)


def test_a_deployment_already_running_the_settings_keeps_getting_them_while_the_pool_is_down() -> None:
    """A Deployment rolled onto the pool while it served (its template or its Pods carry the
    current settings) gets them in a Pod created while the pool does not serve (a node drain,
    a scale-up during a master restart): its connector joins once the pool serves, as with
    Deployment patching. One that never ran them, or ran others, waits for the pool."""
    injection = the_injection()
    pod = replica_set_pod(opted_in())
    down = not_ready("MasterReady")
    expected = admit(pod).patch  # what a serving pool gives it

    restarted = opted_in()
    restarted["spec"]["template"]["metadata"]["annotations"] = {
        names.ANNOTATION_CONFIG_HASH: injection.config_hash
    }
    answer = admit_pod(pod, NAMESPACE, down, running=restarted)
    assert isinstance(answer, PodInjection) and answer.patch == expected
    from_git = opted_in()  # no restart annotation: its injected Pods say what it runs
    answer = admit_pod(pod, NAMESPACE, down, running=from_git, pod_hashes=[injection.config_hash])
    assert isinstance(answer, PodInjection) and answer.patch == expected

    for running, hashes in [(from_git, []), (from_git, ["older"]), (None, [injection.config_hash])]:
        answer = admit_pod(pod, NAMESPACE, down, running=running, pod_hashes=hashes)
        assert isinstance(answer, Refusal) and answer.rule == "pool-not-ready", (running, hashes)
    # Only a pool that does not serve now: gone, being deleted or held back still refuses.
    deleting = serving_pool() | {"metadata": {"name": "pool", "deletionTimestamp": "2024-01-01T00:00:00Z"}}
    answer = admit_pod(pod, NAMESPACE, deleting, running=restarted)
    assert isinstance(answer, Refusal) and answer.rule == "pool-deleting"


def test_a_paused_pool_with_a_newer_spec_says_unpause() -> None:
    pool = serving_pool(generation=2)
    pool["status"]["observedGeneration"] = 1
    pool["metadata"]["annotations"] = {names.ANNOTATION_PAUSED: "true"}
    refusal = refused(replica_set_pod(opted_in()), pool)
    assert (
        refusal.rule == "pool-not-ready" and f"{names.ANNOTATION_PAUSED}=true: remove it" in refusal.message
    )


def test_a_pool_with_a_child_not_its_own_holds_the_pod_back() -> None:
    conflict = {
        "type": "Conflict",
        "status": "True",
        "reason": "NotOwned",
        "message": "ConfigMap pool-connector exists but is not this pool's [ownership]",
    }
    pool = serving_pool()
    pool["status"]["conditions"].append(conflict)
    assert refused(replica_set_pod(opted_in()), pool).rule == "held-back"


def test_a_deployment_the_pool_does_not_list_is_refused() -> None:
    refusal = refused(replica_set_pod(opted_in("other")), serving_pool())
    assert refusal.rule == "not-a-consumer"
    assert "spec.consumers" in refusal.message and f"Deployment {NAMESPACE}/other" in refusal.message


def test_what_deployment_patching_refuses_the_pod_refuses_the_same_way() -> None:
    deployment = opted_in()
    vllm = deployment["spec"]["template"]["spec"]["containers"][0]
    vllm["command"] = ["sh", "-c", "vllm serve org/model"]
    del vllm["args"]
    from_pod = refused(replica_set_pod(deployment), serving_pool())
    from_deployment = injection_refusal(deployment, the_injection())
    assert from_deployment is not None
    assert (from_pod.rule, from_pod.message) == (from_deployment.rule, from_deployment.message)
    assert from_pod.rule == "shell-launch" and '"$@"' in from_pod.message


def test_operator_pods_are_never_consumers() -> None:
    pod = replica_set_pod(opted_in())
    pod["metadata"]["labels"][names.LABEL_PART_OF] = names.PART_OF
    assert refused(pod, serving_pool()).rule == "operator-managed"


def test_consent_is_the_label_on_the_pod_template() -> None:
    injection = the_injection()
    assert template_refusal(opted_in(), injection) is None
    on_metadata_only = vllm_deployment()  # the label on the Deployment, not on its template
    refusal = template_refusal(on_metadata_only, injection)
    assert refusal is not None and refusal.rule == "consent"
    assert "on its pod template (spec.template.metadata.labels)" in refusal.message


def test_a_settings_change_is_one_restart_annotation() -> None:
    old, new = the_injection(), the_injection(pool_spec(connector={"cache_prefix": "team-b"}))
    assert old.config_hash != new.config_hash
    deployment = opted_in()
    deployment["metadata"].update(uid="u1", resourceVersion="7")
    deployment["spec"]["template"]["metadata"]["annotations"] = {
        names.ANNOTATION_CONFIG_HASH: old.config_hash
    }
    assert restart_patch(deployment, old, []) == {}
    patch = restart_patch(deployment, new, [old.config_hash])
    assert patch == {
        "metadata": {"uid": "u1", "resourceVersion": "7"},
        "spec": {"template": {"metadata": {"annotations": {names.ANNOTATION_CONFIG_HASH: new.config_hash}}}},
    }


def test_pods_injected_with_the_current_settings_need_no_restart() -> None:
    injection = the_injection()
    deployment = opted_in()  # as in Git: no restart annotation
    pod = apply_merge_patch(replica_set_pod(deployment), admit(replica_set_pod(deployment)).patch)
    hashes = pod_config_hashes([pod, {"metadata": {"name": "unrelated"}}], "llm")
    assert hashes == [injection.config_hash]
    assert restart_patch(deployment, injection, hashes) == {}
    # Pods from older settings, or Pods refused so far (none runs): one restart; Pods still
    # coming: none.
    assert restart_patch(deployment, injection, ["older"]) != {}
    assert restart_patch(deployment, injection, []) == {}
    deployment["status"] = {
        "conditions": [{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate"}]
    }
    assert restart_patch(deployment, injection, []) != {}
