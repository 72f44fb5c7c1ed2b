"""Consumer Deployments: consent, injecting the pool's connector settings, taking them back out.

A Deployment is patched only with its owner's consent: the label
``kvpool.mooncake.io/allow-pool: <pool>``; never when it is managed by the operator (a
pool's child, the operator itself) or carries another pool's settings.

Both directions are pure: they take the live Deployment and return a JSON merge patch,
empty when nothing has to change. What the API server adds on write
(``fieldRef.apiVersion``, ``configMap.defaultMode``) counts as unchanged, so a settled
consumer is never written again.

The restore record (an annotation) holds only what the operator touched: the container,
the transfer-config flags it replaced (where they were), the entries of its own
environment variables it replaced, and the lists it created. Never the rest of the
consumer's args or env: of those, only a digest (to tell whether they moved).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.connector.contract.identity import NON_CRYPTOGRAPHIC_BLOCK_HASHES
from kvpool.connector.contract.layout import GroupKind, fingerprint
from kvpool.connector.contract.settings import CONFIG_PATH_ENV, CONNECTOR_NAME, ConnectorSettings
from kvpool.operator import names
from kvpool.operator.components import POD_IP_ENV, pod_ip_env
from kvpool.operator.connector_settings import (
    CONFIG_PATH,
    PYTHONHASHSEED,
    consumer_connector_settings,
    kv_transfer_config_json,
)
from kvpool.operator.merge_patch import diff, digest
from kvpool.operator.names import POOLS
from kvpool.operator.network import TRANSFER_PORT_ENV
from kvpool.operator.spec import GrantConsumerSpec

FLAG = "--kv-transfer-config"
FLAG_SPELLINGS = (FLAG, "--kv_transfer_config")
VALUE_ENV = ((CONFIG_PATH_ENV, CONFIG_PATH), ("PYTHONHASHSEED", PYTHONHASHSEED), *TRANSFER_PORT_ENV)
INJECTED_ENV = (POD_IP_ENV, *(name for name, _ in VALUE_ENV))
TOKEN_LISTS = ("command", "args")
# What the API server adds to the entries the operator writes.
DEFAULT_MODE = 420
RECORD_VERSION = 2
# Without a record, an empty list the operator leaves behind is taken to be its own.
CREATED_BY_DEFAULT = ("args", "env", "volumeMounts", "volumes")


class ConsumerError(ValueError):
    """A consumer Deployment the operator cannot patch (e.g. no such container)."""


@dataclass(frozen=True)
class Refusal:
    """Why a consumer Deployment is left alone: the rule and a message naming the Deployment."""

    rule: str
    message: str

    def __str__(self) -> str:
        # "; " separates refusals in the Conflict condition: never inside one.
        return f"{self.message.replace('; ', ', ')} [{self.rule}]"


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
    # The declared layout's dtype: the torch dtypes of its groups (``kvpool-layout`` prints
    # them, e.g. ``bfloat16`` or ``uint8`` for an fp8 cache), never a --kv-cache-dtype name.
    kv_cache_dtype: str = "auto"
    # Whether it has attention groups, whose dtype --kv-cache-dtype sets (Mamba's is its own).
    has_attention: bool = True
    # The pool lets engines hashing blocks with xxhash join (the connector refuses them else).
    allows_weak_block_hash: bool = False
    # A consumer of a grant in another namespace: its namespace and the pool's (empty: the
    # pool's own consumer, in the pool's namespace).
    namespace: str = ""
    pool_namespace: str = ""
    # The grant it uses (``grant_ref``: ``name``, or ``namespace/name`` in another namespace;
    # empty without tenancy). Not in the hash: the tenant in the transfer config is.
    grant: str = ""

    @property
    def display_name(self) -> str:
        """How the pool's status names it: ``<namespace>/<name>`` for another namespace's."""
        return f"{self.namespace}/{self.deployment}" if self.namespace else self.deployment


def plan_injection(
    pool: str,
    consumer: GrantConsumerSpec,
    settings: ConnectorSettings,
    configmap: Mapping[str, Any],
    tenant: str = "",
    namespace: str = "",
    pool_namespace: str = "",
    grant: str = "",
) -> Injection:
    """The injection for ``consumer``; its hash covers what matters to the consumer's pods:
    the transfer config (explicit settings only, never defaults), the env, the mount, the
    layout (``tenant``: the consumer's grant's Mooncake tenant). The ConfigMap's files hold
    the same settings (the transfer config overrides them), so a rendering of the files
    alone never rolls a consumer."""
    consumer_settings = consumer_connector_settings(settings, consumer.layout, tenant)
    kv_config = kv_transfer_config_json(consumer_settings, consumer.kv_role)
    layout_fingerprint = fingerprint(consumer.layout)
    config_hash = digest(
        {
            "kvTransferConfig": kv_config,
            "env": dict(VALUE_ENV),
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
        env=VALUE_ENV,
        layout_fingerprint=layout_fingerprint,
        config_hash=config_hash,
        kv_cache_dtype=consumer.layout.dtype,
        has_attention=any(g.kind != GroupKind.MAMBA for g in consumer.layout.groups),
        allows_weak_block_hash=settings.allow_non_cryptographic_block_hash,
        namespace=namespace,
        pool_namespace=pool_namespace,
        grant=grant,
    )


# --- consent --------------------------------------------------------------------------


def managed_by_operator(deployment: Mapping[str, Any]) -> bool:
    """A pool's child or the operator itself: labelled part of this project, or owned by a pool."""
    meta = deployment.get("metadata") or {}
    labels = meta.get("labels") or {}
    owners = meta.get("ownerReferences") or []
    return (
        labels.get(names.LABEL_PART_OF) == names.PART_OF
        or names.LABEL_COMPONENT in labels
        or any(ref.get("kind") == POOLS.kind and ref.get("apiVersion") == POOLS.api_version for ref in owners)
    )


def refusal(
    deployment: Mapping[str, Any],
    pool: str,
    consent_labels: Mapping[str, Any] | None = None,
    on: str = "",
    pool_namespace: str = "",
) -> Refusal | None:
    """Why ``pool`` (in ``pool_namespace``; default: the Deployment's) may not patch
    ``deployment``; None when its owner let it. The consent labels are read from
    ``consent_labels`` (default: the Deployment's own), which ``on`` names in the message (e.g.
    " on its pod template"). A pool in another namespace needs the consent to name its
    namespace too (``allow-pool-namespace``); one that names another namespace is no consent
    for a pool of the same name here."""
    meta = deployment.get("metadata") or {}
    own = str(meta.get("namespace") or "")
    expected = pool_namespace or own
    where = f"Deployment {own}/{meta.get('name', '')}"
    if managed_by_operator(deployment):
        return Refusal("operator-managed", f"{where} is managed by the operator, never a consumer")
    other = owner_pool(deployment)
    if other is not None and (other != pool or owner_pool_namespace(deployment) != expected):
        other_namespace = owner_pool_namespace(deployment)
        other_pool = repr(other) if other_namespace == own else f"{other_namespace}/{other}"
        return Refusal("other-pool", f"{where} carries pool {other_pool}'s connector settings")
    labels = (meta.get("labels") if consent_labels is None else consent_labels) or {}
    allowed = labels.get(names.LABEL_ALLOW_POOL)
    allowed_namespace = labels.get(names.LABEL_ALLOW_POOL_NAMESPACE) or own
    if allowed != pool or allowed_namespace != expected:
        named = repr(allowed) if allowed_namespace == own else f"{allowed_namespace}/{allowed}"
        found = "has no such label" if allowed is None else f"allows pool {named}"
        label = f"{names.LABEL_ALLOW_POOL}={pool}"
        if expected != own:
            label += f" and {names.LABEL_ALLOW_POOL_NAMESPACE}={expected}"
        return Refusal("consent", f"{where} needs the label {label}{on} to take its settings ({found})")
    return None


# --- what injection cannot do -------------------------------------------------------------

SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh", "ksh", "busybox"})
DTYPE_FLAGS = ("--kv-cache-dtype", "--kv_cache_dtype")
HASH_ALGO_FLAGS = ("--prefix-caching-hash-algo", "--prefix_caching_hash_algo")
# The torch dtype vLLM stores attention KV in for each --kv-cache-dtype (its
# ``STR_DTYPE_TO_TORCH_DTYPE``): the layout's dtype. ``auto`` is the model's dtype, unknown
# here, as is a name not listed: neither is refused.
KV_CACHE_TORCH_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "fp8": "uint8",
    "fp8_e4m3": "uint8",
    "fp8_e5m2": "uint8",
    "fp8_inc": "float8_e4m3fn",
    "fp8_ds_mla": "uint8",
    "int8": "int8",
}


def container_tokens(container: Mapping[str, Any]) -> list[str]:
    """A container's command and args, in order."""
    return [str(t) for t in (container.get("command") or []) + (container.get("args") or [])]


def flag_values(tokens: list[str], spellings: tuple[str, ...]) -> list[str]:
    """The values of a ``--flag value`` / ``--flag=value`` option in ``tokens``."""
    values = []
    for index, token in enumerate(tokens):
        name, eq, inline = token.partition("=")
        if name in spellings:
            values.append(inline if eq else (tokens[index + 1] if index + 1 < len(tokens) else ""))
    return values


def _is_ours(kv_config: str) -> bool:
    """Whether a ``--kv-transfer-config`` value loads this project's connector (an earlier injection)."""
    try:
        parsed = json.loads(kv_config)
    except ValueError:
        return False
    return isinstance(parsed, dict) and parsed.get("kv_connector") == CONNECTOR_NAME


def _looks_like_vllm(container: Mapping[str, Any]) -> bool:
    tokens = container_tokens(container)
    return any("vllm" in t for t in [*tokens, str(container.get("image", ""))])


def choose_container(deployment: Mapping[str, Any], injection: Injection) -> dict[str, Any] | Refusal:
    """The container injection goes into, or why there is none to choose."""
    meta = deployment.get("metadata") or {}
    where = f"Deployment {meta.get('namespace', '')}/{meta.get('name', '')}"
    pod = ((deployment.get("spec") or {}).get("template") or {}).get("spec") or {}
    containers = [c for c in pod.get("containers") or [] if isinstance(c, dict)]
    named = ", ".join(repr(c.get("name")) for c in containers)
    if not containers:
        return Refusal("no-container", f"{where} has no containers")
    if injection.container is not None:
        for container in containers:
            if container.get("name") == injection.container:
                return container
        return Refusal(
            "no-container",
            f"{where} has no container {injection.container!r} (it has {named}): "
            "fix the consumer's container in the pool's spec",
        )
    if len(containers) == 1:
        return containers[0]
    candidates = [c for c in containers if _looks_like_vllm(c)]
    if len(candidates) == 1:
        return candidates[0]
    return Refusal(
        "ambiguous-container",
        f"{where} has {len(containers)} containers ({named}) and {len(candidates) or 'none'} of them "
        "look like vLLM: name the vLLM container in the pool's spec (spec.consumers[].container)",
    )


def injection_refusal(deployment: Mapping[str, Any], injection: Injection) -> Refusal | None:
    """Why the pool's settings would not reach vLLM in this Deployment (refused, never
    injected), or None. What is detected: a shell launch (``sh -c``: appended arguments
    become the shell's ``$0``), a transfer config of another connector (the consumer's own
    would be dropped), a ``--kv-cache-dtype`` whose stored dtype the declared layout lacks
    (the connector would find another layout and stay out of the pool), a block hash that is not collision
    resistant where the pool does not allow one (the connector would refuse to start), no
    container or no single vLLM container to choose."""
    meta = deployment.get("metadata") or {}
    where = f"Deployment {meta.get('namespace', '')}/{meta.get('name', '')}"
    chosen = choose_container(deployment, injection)
    if isinstance(chosen, Refusal):
        return chosen
    command = [str(t) for t in chosen.get("command") or []]
    tokens = command + [str(t) for t in chosen.get("args") or []]
    if (
        command
        and command[0].rsplit("/", 1)[-1] in SHELLS
        and any(t.startswith("-") and not t.startswith("--") and "c" in t for t in tokens[1:3])
    ):
        return Refusal(
            "shell-launch",
            f"{where} starts container {chosen.get('name')!r} through a shell ({' '.join(command[:2])}): "
            "an appended --kv-transfer-config would become the shell's $0 and never reach vLLM: "
            'run vLLM directly (command: [vllm, serve, ...]) or an entrypoint script that passes "$@" on',
        )
    foreign = [v for v in flag_values(tokens, FLAG_SPELLINGS) if not _is_ours(v)]
    if foreign:
        return Refusal(
            "kv-config-set",
            f"{where} sets its own --kv-transfer-config (another connector), which the pool's would "
            "replace: remove it from the Deployment to take the pool's, or leave the pool",
        )
    for dtype in flag_values(tokens, DTYPE_FLAGS):
        stored = KV_CACHE_TORCH_DTYPES.get(dtype)
        if injection.has_attention and stored and stored not in injection.kv_cache_dtype.split(","):
            return Refusal(
                "kv-cache-dtype",
                f"{where} runs --kv-cache-dtype={dtype}, which vLLM stores as {stored}, but the pool "
                f"declares its layout with dtype {injection.kv_cache_dtype!r}: the connector would "
                "stay out of the pool, so declare for this consumer the layout kvpool-layout prints "
                f"with --kv-cache-dtype {dtype} (layout.dtype: {stored})",
            )
    for algorithm in flag_values(tokens, HASH_ALGO_FLAGS):
        if algorithm in NON_CRYPTOGRAPHIC_BLOCK_HASHES and not injection.allows_weak_block_hash:
            return Refusal(
                "block-hash",
                f"{where} runs --prefix-caching-hash-algo={algorithm}, which is not collision "
                "resistant: the connector would refuse to start. Use sha256 (vLLM's default), or set "
                "spec.connector.allow_non_cryptographic_block_hash: true to accept the risk",
            )
    return None


# --- the flag --------------------------------------------------------------------------


def split_flag(tokens: list[str]) -> tuple[list[str], str | None]:
    """``tokens`` without any ``--kv-transfer-config`` (both forms), and its last value."""
    kept, removed = _take_flags(tokens)
    value = None
    for _, flag in removed:
        _, eq, inline = flag[0].partition("=")
        value = inline if eq else (flag[1] if len(flag) > 1 else value)
    return kept, value


def _take_flags(tokens: list[str]) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """``tokens`` without the flags, and each flag removed: (its index, its tokens)."""
    kept: list[str] = []
    removed: list[tuple[int, list[str]]] = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        name, eq, _ = token.partition("=")
        if name in FLAG_SPELLINGS:
            width = 1 if eq or index + 1 >= len(tokens) else 2
            removed.append((index, list(tokens[index : index + width])))
            index += width
            continue
        kept.append(token)
        index += 1
    return kept, removed


def _put_back(tokens: list[str], removed: list[list[Any]], in_place: bool) -> list[str]:
    """``tokens`` with removed flags put back: at their indices when ``in_place`` (the other
    tokens are as they were), else at the end."""
    out = list(tokens)
    for index, flag in sorted(removed, key=lambda item: item[0]):
        position = min(int(index), len(out)) if in_place else len(out)
        out[position:position] = [str(t) for t in flag]
    return out


# --- injection --------------------------------------------------------------------------


def _mounts_connector(container: Mapping[str, Any]) -> bool:
    """Whether the operator's connector volume is mounted in ``container`` (injected there)."""
    return any(
        isinstance(m, Mapping) and m.get("name") == names.CONNECTOR_VOLUME
        for m in container.get("volumeMounts") or []
    )


def as_served(entry: Mapping[str, Any]) -> dict[str, Any]:
    """An entry the operator writes, as the API server stores it (with its defaults)."""
    out = copy.deepcopy(dict(entry))
    field_ref = (out.get("valueFrom") or {}).get("fieldRef")
    if isinstance(field_ref, dict):
        field_ref.setdefault("apiVersion", "v1")
    if isinstance(out.get("configMap"), dict):
        out["configMap"].setdefault("defaultMode", DEFAULT_MODE)
    return out


def _upsert(items: list[dict[str, Any]], entry: dict[str, Any]) -> list[dict[str, Any]]:
    """``items`` with ``entry`` in place of the item of its name (appended if none);
    an item equal to ``entry`` as the server stores it is kept as it is."""
    out = list(items)
    for index, item in enumerate(out):
        if item.get("name") == entry["name"]:
            if item not in (entry, as_served(entry)):
                out[index] = entry
            return out
    return [*out, entry]


def _remove(items: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [item for item in items if item.get("name") != name]


def _set_or_drop(obj: dict[str, Any], key: str, value: Any) -> None:
    if value:
        obj[key] = value
    else:
        obj.pop(key, None)


def guarded(patch: dict[str, Any], live: Mapping[str, Any]) -> dict[str, Any]:
    """A non-empty patch applies only to the object it was computed from (409 otherwise)."""
    meta = live.get("metadata", {})
    if patch:
        for key in ("uid", "resourceVersion"):
            if meta.get(key):
                patch.setdefault("metadata", {})[key] = meta[key]
    return patch


def restore_record(container: Mapping[str, Any], pod: Mapping[str, Any]) -> dict[str, Any]:
    """What injection is about to touch in ``container``: only what restore has to give back."""
    flags = []
    others = {}  # a digest of the tokens around the flags: were they left as they were?
    for key in TOKEN_LISTS:
        kept, removed = _take_flags(list(container.get(key) or []))
        flags += [[key, index, tokens] for index, tokens in removed]
        others[key] = digest(kept)
    replaced = {e["name"]: e for e in container.get("env") or [] if e.get("name") in INJECTED_ENV}
    created = [key for key in ("args", "env", "volumeMounts") if key not in container]
    if "volumes" not in pod:
        created.append("volumes")
    return {
        "version": RECORD_VERSION,
        "container": container.get("name"),
        "flags": flags,
        "others": others,
        "env": replaced,
        "created": created,
    }


def injected(deployment: Mapping[str, Any], injection: Injection) -> dict[str, Any]:
    """The Deployment with the injection applied (a new object). Moved to another container
    (``spec.consumers[].container`` changed), it is first taken out of the one it was in."""
    chosen = choose_container(deployment, injection)
    recorded = read_record(
        ((deployment.get("metadata") or {}).get("annotations") or {}).get(names.ANNOTATION_RESTORE)
    )
    if not isinstance(chosen, Refusal) and recorded.get("container") not in (None, chosen.get("name")):
        deployment = restored(deployment)
    new = copy.deepcopy(dict(deployment))
    meta = new.setdefault("metadata", {})
    template = new.setdefault("spec", {}).setdefault("template", {})
    pod = template.setdefault("spec", {})
    container = choose_container(new, injection)
    if isinstance(container, Refusal):
        raise ConsumerError(str(container))

    annotations = meta.setdefault("annotations", {})
    if names.ANNOTATION_RESTORE not in annotations:
        annotations[names.ANNOTATION_RESTORE] = json.dumps(
            restore_record(container, pod), sort_keys=True, separators=(",", ":")
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
    if injection.pool_namespace:  # a consumer in another namespace: which pool, for its NetworkPolicy
        template_meta["labels"][names.LABEL_POOL_NAMESPACE] = injection.pool_namespace
        meta["labels"][names.LABEL_POOL_NAMESPACE] = injection.pool_namespace
    template_meta.setdefault("annotations", {})[names.ANNOTATION_CONFIG_HASH] = injection.config_hash
    return new


def inject_patch(deployment: Mapping[str, Any], injection: Injection) -> dict[str, Any]:
    """The merge patch that injects the settings; empty when they are already in place."""
    return guarded(diff(deployment, injected(deployment, injection)), deployment)


# --- restoring --------------------------------------------------------------------------


def _restore_container(container: dict[str, Any], record: Mapping[str, Any]) -> None:
    """Take the flag, env and mount out; put back what the flag and env replaced."""
    flags = [f for f in record.get("flags") or [] if isinstance(f, list) and len(f) == 3]
    for key in TOKEN_LISTS:
        if key not in container and not any(f[0] == key for f in flags):
            continue
        tokens = split_flag(list(container.get(key) or []))[0]
        in_place = (record.get("others") or {}).get(key) == digest(tokens)
        container[key] = _put_back(tokens, [[f[1], f[2]] for f in flags if f[0] == key], in_place)
    replaced = record.get("env") or {}
    env = []
    for entry in container.get("env") or []:
        name = entry.get("name")
        if name not in INJECTED_ENV:
            env.append(entry)
        elif name in replaced:
            env.append(replaced[name])
    container["env"] = env
    container["volumeMounts"] = _remove(list(container.get("volumeMounts") or []), names.CONNECTOR_VOLUME)
    created = set(record.get("created", CREATED_BY_DEFAULT))
    for key in ("args", "env", "volumeMounts"):
        if key in created and not container.get(key):
            container.pop(key, None)


def record_problem(raw: str | None) -> str | None:
    """What is wrong with a restore record (None: none, or no record at all)."""
    if raw is None:
        return None
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):
        return "not JSON"
    if not isinstance(record, dict):
        return "not a JSON object"
    if record.get("version") != RECORD_VERSION:
        return f"version {record.get('version')!r} is not {RECORD_VERSION}"
    shapes = {"container": (str, type(None)), "flags": list, "others": dict, "env": dict, "created": list}
    for key, shape in shapes.items():
        if key in record and not isinstance(record[key], shape):
            return f"{key!r} has the wrong type"
    for flag in record.get("flags") or []:
        if not (
            isinstance(flag, list)
            and len(flag) == 3
            and flag[0] in TOKEN_LISTS
            and isinstance(flag[1], int)
            and isinstance(flag[2], list)
        ):
            return f"the flag entry {flag!r} is malformed"
    if not all(isinstance(entry, dict) for entry in (record.get("env") or {}).values()):
        return "an env entry is not an object"
    if not all(isinstance(key, str) for key in record.get("created") or []):
        return "'created' lists a non-string"
    return None


def read_record(raw: str | None) -> dict[str, Any]:
    """The restore record, or ``{}`` when there is none or it is malformed: restoring then
    takes out everything the operator injects and puts back nothing it cannot read."""
    if raw is None or record_problem(raw) is not None:
        return {}
    return dict(json.loads(raw))


def restore_problem(deployment: Mapping[str, Any]) -> str | None:
    """What is wrong with a Deployment's restore record, if anything (for an Event)."""
    return record_problem(
        ((deployment.get("metadata") or {}).get("annotations") or {}).get(names.ANNOTATION_RESTORE)
    )


def restored(deployment: Mapping[str, Any]) -> dict[str, Any]:
    """The Deployment with everything the operator injected taken back out."""
    new = copy.deepcopy(dict(deployment))
    meta = new.setdefault("metadata", {})
    raw_record = (meta.get("annotations") or {}).get(names.ANNOTATION_RESTORE)
    if raw_record is None and owner_pool(deployment) is None:
        return new  # never injected: nothing of ours to take out
    record = read_record(raw_record)
    template = new.setdefault("spec", {}).setdefault("template", {})
    pod = template.setdefault("spec", {})
    # The recorded container gets back what the record says; any other the connector's
    # volume is mounted in (its record lost) only loses what the operator injects. A container
    # the operator never touched is left as it is.
    recorded = record.get("container")
    for container in pod.get("containers") or []:
        if not isinstance(container, dict):
            continue
        if recorded is not None and container.get("name") == recorded:
            _restore_container(container, record)
        elif _mounts_connector(container):
            _restore_container(container, record if recorded is None else {})
    volumes = _remove(list(pod.get("volumes") or []), names.CONNECTOR_VOLUME)
    if volumes or "volumes" not in set(record.get("created", CREATED_BY_DEFAULT)):
        pod["volumes"] = volumes
    else:
        pod.pop("volumes", None)
    template_meta = template.get("metadata") or {}
    injected_keys = (
        (names.LABEL_POOL, "labels"),
        (names.LABEL_POOL_NAMESPACE, "labels"),
        (names.ANNOTATION_CONFIG_HASH, "annotations"),
    )
    for key, field in injected_keys:
        values = dict(template_meta.get(field) or {})
        values.pop(key, None)
        _set_or_drop(template_meta, field, values)
    own_keys = (
        (names.LABEL_CONSUMER_OF, "labels"),
        (names.LABEL_POOL_NAMESPACE, "labels"),
        (names.ANNOTATION_RESTORE, "annotations"),
    )
    for key, field in own_keys:
        values = dict(meta.get(field) or {})
        values.pop(key, None)
        _set_or_drop(meta, field, values)
    return new


def restore_patch(deployment: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that takes the injected settings back out; empty when none are in."""
    return guarded(diff(deployment, restored(deployment)), deployment)


def owner_pool(deployment: Mapping[str, Any]) -> str | None:
    """The pool whose settings a Deployment carries, if any."""
    return (deployment.get("metadata", {}).get("labels") or {}).get(names.LABEL_CONSUMER_OF)


def owner_pool_namespace(deployment: Mapping[str, Any]) -> str:
    """The namespace of that pool: the label another namespace's pool sets, else the Deployment's own."""
    meta = deployment.get("metadata") or {}
    return str((meta.get("labels") or {}).get(names.LABEL_POOL_NAMESPACE) or meta.get("namespace") or "")


def config_hash_of(deployment: Mapping[str, Any]) -> str | None:
    """The config hash on a Deployment's pod template."""
    template_meta = deployment.get("spec", {}).get("template", {}).get("metadata") or {}
    return (template_meta.get("annotations") or {}).get(names.ANNOTATION_CONFIG_HASH)
