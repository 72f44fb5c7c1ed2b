"""Consumer Deployments: inject the pool's connector settings, and take them back out.

Both directions are pure: they take the live Deployment and return a JSON merge patch
(empty when nothing has to change, so an unchanged config hash writes nothing).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.connector.contract.layout import fingerprint
from kvpool.connector.contract.settings import CONFIG_PATH_ENV, ConnectorSettings
from kvpool.operator import names
from kvpool.operator.components import POD_IP_ENV, pod_ip_env
from kvpool.operator.connector_settings import CONFIG_PATH, PYTHONHASHSEED, consumer_connector_settings
from kvpool.operator.merge_patch import diff, digest
from kvpool.operator.spec import ConsumerSpec

FLAG = "--kv-transfer-config"
FLAG_SPELLINGS = (FLAG, "--kv_transfer_config")
INJECTED_ENV = (POD_IP_ENV, CONFIG_PATH_ENV, "PYTHONHASHSEED")


class ConsumerError(ValueError):
    """A consumer Deployment the operator cannot patch (e.g. no such container)."""


@dataclass(frozen=True)
class Injection:
    """What one consumer gets: the transfer config, the mounted ConfigMap, the env, the hash."""

    pool: str
    deployment: str
    container: str | None
    kv_transfer_config: str
    config_map: str
    env: tuple[tuple[str, str], ...]
    layout_fingerprint: str
    config_hash: str


def plan_injection(
    pool: str, consumer: ConsumerSpec, settings: ConnectorSettings, configmap: Mapping[str, Any]
) -> Injection:
    """The injection for ``consumer``; its hash covers everything that reaches the pods."""
    kv_config = consumer_connector_settings(settings).kv_transfer_config_json(consumer.kv_role)
    env = ((CONFIG_PATH_ENV, CONFIG_PATH), ("PYTHONHASHSEED", PYTHONHASHSEED))
    layout_fingerprint = fingerprint(consumer.layout)
    config_hash = digest(
        {
            "kvTransferConfig": kv_config,
            "configMap": dict(configmap["data"]),
            "env": dict(env),
            "mountPath": names.CONNECTOR_MOUNT_PATH,
            "layout": layout_fingerprint,
        }
    )
    return Injection(
        pool=pool,
        deployment=consumer.name,
        container=consumer.container,
        kv_transfer_config=kv_config,
        config_map=configmap["metadata"]["name"],
        env=env,
        layout_fingerprint=layout_fingerprint,
        config_hash=config_hash,
    )


def split_flag(tokens: list[str]) -> tuple[list[str], str | None]:
    """``tokens`` without any ``--kv-transfer-config`` (both forms), and its last value."""
    out: list[str] = []
    value: str | None = None
    skip = False
    for index, token in enumerate(tokens):
        if skip:
            skip = False
            continue
        name, eq, inline = token.partition("=")
        if name in FLAG_SPELLINGS:
            if eq:
                value = inline
            elif index + 1 < len(tokens):
                value, skip = tokens[index + 1], True
            continue
        out.append(token)
    return out, value


def _container(pod: dict[str, Any], name: str | None) -> dict[str, Any]:
    containers = pod.get("containers") or []
    if not containers:
        raise ConsumerError("the Deployment has no containers")
    if name is None:
        return containers[0]
    for container in containers:
        if container.get("name") == name:
            return container
    raise ConsumerError(f"the Deployment has no container {name!r}")


def _upsert(items: list[dict[str, Any]], entry: dict[str, Any]) -> list[dict[str, Any]]:
    out = [item for item in items if item.get("name") != entry["name"]]
    return [*out, entry]


def _remove(items: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [item for item in items if item.get("name") != name]


def _set_or_drop(obj: dict[str, Any], key: str, value: Any) -> None:
    if value:
        obj[key] = value
    else:
        obj.pop(key, None)


def _with_resource_version(patch: dict[str, Any], live: Mapping[str, Any]) -> dict[str, Any]:
    version = live.get("metadata", {}).get("resourceVersion")
    if patch and version:
        patch.setdefault("metadata", {})["resourceVersion"] = version
    return patch


def injected(deployment: Mapping[str, Any], injection: Injection) -> dict[str, Any]:
    """The Deployment with the injection applied (a new object)."""
    new = copy.deepcopy(dict(deployment))
    meta = new.setdefault("metadata", {})
    template = new.setdefault("spec", {}).setdefault("template", {})
    pod = template.setdefault("spec", {})
    container = _container(pod, injection.container)

    annotations = meta.setdefault("annotations", {})
    if names.ANNOTATION_RESTORE not in annotations:
        annotations[names.ANNOTATION_RESTORE] = json.dumps(
            {
                "container": container.get("name"),
                "command": container.get("command"),
                "args": container.get("args"),
                "env": container.get("env"),
            },
            sort_keys=True,
            separators=(",", ":"),
        )
    meta.setdefault("labels", {})[names.LABEL_CONSUMER_OF] = injection.pool

    if "command" in container:
        container["command"] = split_flag(list(container["command"] or []))[0]
    args = split_flag(list(container.get("args") or []))[0]
    container["args"] = [*args, f"{FLAG}={injection.kv_transfer_config}"]
    env = _upsert(list(container.get("env") or []), pod_ip_env())
    for name, value in injection.env:
        env = _upsert(env, {"name": name, "value": value})
    container["env"] = env
    container["volumeMounts"] = _upsert(
        list(container.get("volumeMounts") or []),
        {"name": names.CONNECTOR_VOLUME, "mountPath": names.CONNECTOR_MOUNT_PATH, "readOnly": True},
    )
    pod["volumes"] = _upsert(
        list(pod.get("volumes") or []),
        {"name": names.CONNECTOR_VOLUME, "configMap": {"name": injection.config_map}},
    )
    template_meta = template.setdefault("metadata", {})
    template_meta.setdefault("labels", {})[names.LABEL_POOL] = injection.pool
    template_meta.setdefault("annotations", {})[names.ANNOTATION_CONFIG_HASH] = injection.config_hash
    return new


def inject_patch(deployment: Mapping[str, Any], injection: Injection) -> dict[str, Any]:
    """The merge patch that injects the settings; empty when they are already in place."""
    return _with_resource_version(diff(deployment, injected(deployment, injection)), deployment)


def _restore_tokens(
    container: dict[str, Any], key: str, original: list[str] | None, fallback_value: str | None
) -> bool:
    """Restore ``command`` or ``args``; whether the original came back exactly."""
    if key not in container and original is None:
        return True
    current = list(container.get(key) or [])
    if original is not None and split_flag(list(original))[0] == split_flag(current)[0]:
        container[key] = list(original)
        return True
    tokens = split_flag(current)[0]
    if fallback_value is not None:
        tokens.append(f"{FLAG}={fallback_value}")
    _set_or_drop(container, key, tokens)
    return False


def _restore_env(container: dict[str, Any], original: list[dict[str, Any]] | None) -> None:
    def kept(env: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [e for e in env if e.get("name") not in INJECTED_ENV]

    current = list(container.get("env") or [])
    if original is not None and kept(list(original)) == kept(current):
        container["env"] = list(original)
        return
    ours = [e for e in original or [] if e.get("name") in INJECTED_ENV]
    _set_or_drop(container, "env", kept(current) + ours)


def _restore_container(container: dict[str, Any], record: Mapping[str, Any]) -> None:
    """Take the flag, env and mount out; exactly the original lists where nothing else moved."""
    original_args, original_command = record.get("args"), record.get("command")
    command_exact = _restore_tokens(container, "command", original_command, None)
    value = split_flag(list(original_args or []))[1]
    if value is None and not command_exact:
        value = split_flag(list(original_command or []))[1]
    _restore_tokens(container, "args", original_args, value)
    _restore_env(container, record.get("env"))
    _set_or_drop(
        container, "volumeMounts", _remove(list(container.get("volumeMounts") or []), names.CONNECTOR_VOLUME)
    )


def restored(deployment: Mapping[str, Any]) -> dict[str, Any]:
    """The Deployment with everything the operator injected taken back out."""
    new = copy.deepcopy(dict(deployment))
    meta = new.setdefault("metadata", {})
    raw_record = (meta.get("annotations") or {}).get(names.ANNOTATION_RESTORE)
    if raw_record is None and owner_pool(deployment) is None:
        return new  # never injected: nothing of ours to take out
    try:
        record = json.loads(raw_record or "{}")
    except json.JSONDecodeError:
        record = {}
    template = new.setdefault("spec", {}).setdefault("template", {})
    pod = template.setdefault("spec", {})
    try:
        container: dict[str, Any] | None = _container(pod, record.get("container"))
    except ConsumerError:
        container = None
    if container is not None:
        _restore_container(container, record)
    _set_or_drop(pod, "volumes", _remove(list(pod.get("volumes") or []), names.CONNECTOR_VOLUME))
    template_meta = template.get("metadata") or {}
    for key, field in ((names.LABEL_POOL, "labels"), (names.ANNOTATION_CONFIG_HASH, "annotations")):
        values = dict(template_meta.get(field) or {})
        values.pop(key, None)
        _set_or_drop(template_meta, field, values)
    for key, field in ((names.LABEL_CONSUMER_OF, "labels"), (names.ANNOTATION_RESTORE, "annotations")):
        values = dict(meta.get(field) or {})
        values.pop(key, None)
        _set_or_drop(meta, field, values)
    return new


def restore_patch(deployment: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that takes the injected settings back out; empty when none are in."""
    return _with_resource_version(diff(deployment, restored(deployment)), deployment)


def owner_pool(deployment: Mapping[str, Any]) -> str | None:
    """The pool whose settings a Deployment carries, if any."""
    return (deployment.get("metadata", {}).get("labels") or {}).get(names.LABEL_CONSUMER_OF)


def config_hash_of(deployment: Mapping[str, Any]) -> str | None:
    """The config hash on a Deployment's pod template."""
    template_meta = deployment.get("spec", {}).get("template", {}).get("metadata") or {}
    return (template_meta.get("annotations") or {}).get(names.ANNOTATION_CONFIG_HASH)
