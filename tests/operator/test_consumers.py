"""Consumer Deployments: injection and restoration as pure merge patches."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.operator import names
from kvpool.operator.consumers import (
    ConsumerError,
    Injection,
    inject_patch,
    injected,
    restore_patch,
    restored,
    split_flag,
)
from kvpool.operator.merge_patch import apply_merge_patch
from kvpool.operator.plan import build_plan
from testing.operator_objects import (
    ORIGINAL_KV_CONFIG,
    consumer,
    full_group,
    layout,
    pool_spec,
    stored,
    vllm_deployment,
)


def injection(**overrides: Any) -> Injection:
    return build_plan("pool", "team-a", pool_spec(**overrides)).consumers[0]


def vllm(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def flags(container: dict[str, Any]) -> list[str]:
    tokens = list(container.get("command") or []) + list(container.get("args") or [])
    return [t for t in tokens if t.startswith(("--kv-transfer-config", "--kv_transfer_config"))]


def test_injection_replaces_the_transfer_config_and_mounts_the_settings() -> None:
    inj = injection()
    original = vllm_deployment(kv_config=ORIGINAL_KV_CONFIG)
    new = apply_merge_patch(original, inject_patch(original, inj))
    c = vllm(new)
    assert flags(c) == [f"--kv-transfer-config={inj.kv_transfer_config}"]
    assert c["args"][:4] == ["--model", "org/model", "--port", "8000"]
    env = {e["name"]: e for e in c["env"]}
    assert env["MOONCAKE_CONFIG_PATH"]["value"] == "/etc/kvpool/mooncake.json"
    assert env["PYTHONHASHSEED"]["value"] == "0"
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["HF_HOME"]["value"] == "/cache"
    assert {"name": names.CONNECTOR_VOLUME, "mountPath": "/etc/kvpool", "readOnly": True} in (
        c["volumeMounts"]
    )
    pod = new["spec"]["template"]
    assert {"name": names.CONNECTOR_VOLUME, "configMap": {"name": "pool-connector"}} in (
        pod["spec"]["volumes"]
    )
    assert pod["metadata"]["annotations"][names.ANNOTATION_CONFIG_HASH] == inj.config_hash
    assert pod["metadata"]["labels"][names.LABEL_POOL] == "pool"
    assert new["metadata"]["labels"][names.LABEL_CONSUMER_OF] == "pool"
    # The sidecar is untouched.
    assert (
        new["spec"]["template"]["spec"]["containers"][1]
        == (original["spec"]["template"]["spec"]["containers"][1])
    )


def test_the_rendered_transfer_config_is_the_contracts() -> None:
    kv = json.loads(injection().kv_transfer_config)
    assert kv["kv_connector"] == "KVPoolConnector"
    assert kv["kv_connector_module_path"] == "kvpool.connector"
    extra = kv["kv_connector_extra_config"]
    assert extra["cache_prefix"] == "team-a"
    assert extra["master_server_address"] == "pool-master.team-a.svc:50051"
    assert extra["local_hostname"] == extra["bind_address"] == "$(POD_IP)"  # serves and binds on its pod IP
    assert ConnectorSettings.parse(extra).tcp_bind_address == "$(POD_IP)"
    # What differs from the contract's defaults, and the mounted file's fields (always):
    # the connector applies its own defaults to the rest.
    assert "batch_size" not in extra
    assert extra["global_segment_size"] == 0 and extra["protocol"] == "tcp"
    assert ConnectorSettings.parse(extra).global_segment_size == 0


def test_a_pod_of_the_old_template_keeps_its_settings_when_the_file_changes(tmp_path: Path) -> None:
    """The ConfigMap is rewritten before the rollout reaches a consumer: a Pod of the old
    template that restarts in between mounts the new file under its old flag."""
    old = build_plan("pool", "team-a", pool_spec())
    new = build_plan(
        "pool",
        "team-a",
        pool_spec(
            store={"segmentSize": "1GB", "replicas": 2, "protocol": "rdma", "rdmaDevices": ["mlx5_0"]},
            connector={"cache_prefix": "team-a", "local_buffer_size": "128MB", "metadata_server": "etcd:1"},
        ),
    )
    old_flag = json.loads(old.consumers[0].kv_transfer_config)["kv_connector_extra_config"]

    def settings_with(plan: Any) -> ConnectorSettings:
        (configmap,) = [c for c in plan.children if c["metadata"]["name"] == "pool-connector"]
        path = tmp_path / f"{id(plan)}.json"
        path.write_text(configmap["data"][names.MOONCAKE_CONFIG_FILE])
        return ConnectorSettings.from_sources(old_flag, {"MOONCAKE_CONFIG_PATH": str(path)})

    assert settings_with(new) == settings_with(old)
    assert settings_with(old).protocol == "tcp" and settings_with(old).metadata_server == "P2PHANDSHAKE"


def test_an_unchanged_hash_changes_nothing() -> None:
    inj = injection()
    once = injected(vllm_deployment(kv_config=ORIGINAL_KV_CONFIG), inj)
    assert inject_patch(once, inj) == {}


def test_a_new_hash_patches_only_what_changed() -> None:
    once = injected(vllm_deployment(kv_config=ORIGINAL_KV_CONFIG), injection())
    once["metadata"]["resourceVersion"] = "41"
    other = injection(connector={"cache_prefix": "other"})
    patch = inject_patch(once, other)
    assert patch["metadata"] == {"resourceVersion": "41"}
    template = patch["spec"]["template"]
    assert template["metadata"] == {"annotations": {names.ANNOTATION_CONFIG_HASH: other.config_hash}}
    assert set(template["spec"]) == {"containers"}  # volumes and the rest unchanged
    assert flags(vllm(apply_merge_patch(once, patch))) == [f"--kv-transfer-config={other.kv_transfer_config}"]


@pytest.mark.parametrize(
    "tokens",
    [
        ["--kv-transfer-config", "{}", "--x"],
        ["--kv-transfer-config={}", "--x"],
        ["--kv_transfer_config", "{}", "--x"],
        ["--x", "--kv_transfer_config={}"],
    ],
)
def test_every_spelling_of_the_flag_is_replaced(tokens: list[str]) -> None:
    assert split_flag(tokens) == (["--x"], "{}")
    deployment = vllm_deployment(kv_config=ORIGINAL_KV_CONFIG)
    vllm(deployment)["args"] = tokens
    assert len(flags(vllm(injected(deployment, injection())))) == 1


def test_a_flag_in_the_command_is_replaced_too() -> None:
    deployment = vllm_deployment(kv_config=ORIGINAL_KV_CONFIG)
    c = vllm(deployment)
    c["command"] = ["vllm", "serve", "m", "--kv-transfer-config", ORIGINAL_KV_CONFIG]
    del c["args"]
    new = injected(deployment, injection())
    assert vllm(new)["command"] == ["vllm", "serve", "m"]
    assert len(flags(vllm(new))) == 1
    assert restored(new) == deployment


def test_restoring_gives_back_the_original() -> None:
    original = vllm_deployment(kv_config=ORIGINAL_KV_CONFIG)
    once = injected(original, injection())
    twice = injected(once, injection(connector={"cache_prefix": "other"}))
    assert restored(twice) == original
    assert apply_merge_patch(twice, restore_patch(twice)) == original
    assert restore_patch(original) == {}


def test_restoring_keeps_changes_made_in_between() -> None:
    once = injected(vllm_deployment(kv_config=ORIGINAL_KV_CONFIG), injection())
    vllm(once)["args"].insert(0, "--enforce-eager")
    vllm(once)["env"].append({"name": "EXTRA", "value": "1"})
    back = vllm(restored(once))
    # The args moved: the consumer's own flag comes back at the end, as it was written.
    assert back["args"] == [
        "--enforce-eager",
        "--model",
        "org/model",
        "--port",
        "8000",
        "--kv-transfer-config",
        ORIGINAL_KV_CONFIG,
    ]
    assert [e["name"] for e in back["env"]] == ["HF_HOME", "PYTHONHASHSEED", "EXTRA"]
    assert {"name": "PYTHONHASHSEED", "value": "42"} in back["env"]


def proxy_first() -> dict[str, Any]:
    """A Deployment whose first container is a proxy with env of its own the operator also
    sets in the container it injects (``POD_IP``, ``PYTHONHASHSEED``)."""
    deployment = vllm_deployment()
    proxy = {
        "name": "proxy",
        "image": "envoy",
        "env": [
            {"name": "POD_IP", "value": "proxy's own"},
            {"name": "PYTHONHASHSEED", "value": "7"},
        ],
    }
    deployment["spec"]["template"]["spec"]["containers"].insert(0, proxy)
    return deployment


@pytest.mark.parametrize("record", ["lost", "unreadable", "another version"])
def test_without_its_record_restoring_takes_out_only_what_was_injected(record: str) -> None:
    """The record names the container injected into; without it, the containers the connector
    volume is mounted in lose what the operator injects, and no other container is touched
    (the first one is not taken for the injected one)."""
    original = proxy_first()
    new = injected(original, injection())
    annotations = new["metadata"]["annotations"]
    if record == "lost":
        del annotations[names.ANNOTATION_RESTORE]
    elif record == "unreadable":
        annotations[names.ANNOTATION_RESTORE] = "{not json"
    else:
        annotations[names.ANNOTATION_RESTORE] = json.dumps(
            {**json.loads(annotations[names.ANNOTATION_RESTORE]), "version": 1}
        )
    back = restored(new)
    proxy, vllm_back, sidecar = back["spec"]["template"]["spec"]["containers"]
    assert proxy == original["spec"]["template"]["spec"]["containers"][0]
    assert sidecar == original["spec"]["template"]["spec"]["containers"][2]
    assert flags(vllm_back) == [] and "volumeMounts" not in vllm_back
    # No container mounts a volume the pod no longer has.
    assert "volumes" not in back["spec"]["template"]["spec"]


def test_moving_the_injection_to_another_container_takes_it_out_of_the_first() -> None:
    original = proxy_first()
    into_vllm = injected(original, injection())
    moved = injected(into_vllm, injection(consumers=[{**consumer(), "container": "sidecar"}]))
    proxy, vllm_moved, sidecar = moved["spec"]["template"]["spec"]["containers"]
    assert vllm_moved == original["spec"]["template"]["spec"]["containers"][1]
    assert len(flags(sidecar)) == 1 and proxy == original["spec"]["template"]["spec"]["containers"][0]
    assert json.loads(moved["metadata"]["annotations"][names.ANNOTATION_RESTORE])["container"] == "sidecar"
    assert restored(moved) == original


def test_a_missing_container_is_reported() -> None:
    with pytest.raises(ConsumerError, match="no container 'vllm'"):
        injected(
            vllm_deployment(kv_config=ORIGINAL_KV_CONFIG)
            | {"spec": {"template": {"spec": {"containers": [{"name": "other", "image": "x"}]}}}},
            injection(),
        )


def test_the_first_container_is_the_default() -> None:
    inj = build_plan(
        "pool",
        "team-a",
        pool_spec(consumers=[{"name": "llm", "layout": layout(full_group())}]),
    ).consumers[0]
    assert inj.container is None
    assert len(flags(vllm(injected(vllm_deployment(kv_config=ORIGINAL_KV_CONFIG), inj)))) == 1


tokens = st.lists(
    st.sampled_from(
        [
            "--model",
            "m",
            "--port",
            "8000",
            "--kv-transfer-config",
            "{}",
            "--kv_transfer_config={}",
            "-tp",
            "2",
        ]
    ),
    max_size=8,
)
env_entries = st.lists(
    st.builds(
        lambda n, v: {"name": n, "value": v},
        st.sampled_from(["A", "B", "PYTHONHASHSEED", "POD_IP", "MOONCAKE_CONFIG_PATH"]),
        st.sampled_from(["1", "2"]),
    ),
    max_size=4,
    unique_by=lambda e: e["name"],
)


@settings(max_examples=150, deadline=None)
@given(
    args=st.none() | tokens, command=st.none() | tokens, env=st.none() | env_entries, volumes=st.booleans()
)
def test_inject_then_restore_is_the_identity(
    args: list[str] | None,
    command: list[str] | None,
    env: list[dict[str, str]] | None,
    volumes: bool,
) -> None:
    deployment = vllm_deployment(kv_config=ORIGINAL_KV_CONFIG)
    c = vllm(deployment)
    for key, value in (("args", args), ("command", command), ("env", env)):
        if value is None:
            c.pop(key, None)
        else:
            c[key] = value
    if volumes:
        deployment["spec"]["template"]["spec"]["volumes"] = [{"name": "cache", "emptyDir": {}}]
    original = copy.deepcopy(deployment)
    new = injected(deployment, injection())
    assert deployment == original  # pure
    assert len(flags(vllm(new))) == 1
    assert inject_patch(new, injection()) == {}
    assert restored(new) == original


def test_what_the_api_server_adds_is_no_change() -> None:
    """Settled: the injected Deployment as the server stores it (fieldRef.apiVersion,
    configMap.defaultMode, ...) needs no patch, so it is never written again."""
    served = stored(injected(vllm_deployment(kv_config=ORIGINAL_KV_CONFIG), injection()))
    volume = {"name": names.CONNECTOR_VOLUME, "configMap": {"name": "pool-connector", "defaultMode": 420}}
    assert volume in served["spec"]["template"]["spec"]["volumes"]
    assert inject_patch(served, injection()) == {}
    assert vllm(restored(served))["env"] == vllm(stored(vllm_deployment(kv_config=ORIGINAL_KV_CONFIG)))["env"]


def test_the_restore_record_keeps_only_what_the_operator_touched() -> None:
    deployment = vllm_deployment(kv_config=ORIGINAL_KV_CONFIG)
    c = vllm(deployment)
    c["env"].append({"name": "API_KEY", "value": "s3cr3t-in-env"})
    c["args"] += ["--api-key", "s3cr3t-in-args"]
    original = copy.deepcopy(deployment)
    new = injected(deployment, injection())
    record = new["metadata"]["annotations"][names.ANNOTATION_RESTORE]
    for other in ("s3cr3t", "HF_HOME", "/cache", "org/model", "8000"):
        assert other not in record, other
    parsed = json.loads(record)
    assert parsed["env"] == {"PYTHONHASHSEED": {"name": "PYTHONHASHSEED", "value": "42"}}
    assert parsed["flags"] == [["args", 2, ["--kv-transfer-config", ORIGINAL_KV_CONFIG]]]
    assert restored(new) == original
