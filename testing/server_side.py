"""What a real Kubernetes API server does to an object on write, as pure functions.

The emulated API (``testing.kube_api``) applies these so that the operator meets
what it would meet on a real cluster:

* built-in defaults: Deployments (strategy, revisionHistoryLimit, ...), pod templates
  (``fieldRef.apiVersion: v1``, ``configMap.defaultMode: 420``, probe timings, ...),
  Services (``protocol: TCP``, ``targetPort``, ``clusterIP``, ...) and NetworkPolicies
  (``policyTypes``, ``protocol: TCP``) -- each as in Kubernetes' ``SetDefaults_*``;
* custom resources: unknown fields pruned and the defaults of the CRD's structural schema
  applied (never inside ``metadata``), then validated by it (its CEL rules aside);
* the status subresource: a write to the main resource keeps the stored status, a write
  to ``/status`` changes nothing but the status;
* ``metadata.resourceVersion`` and ``preconditions`` as optimistic locks (409 Conflict);
* ``metadata.generation`` bumped when the spec changes, and only then;
* ``labelSelector`` on lists;
* the validation the operator's writes could break (422 ``Invalid``, the field path in the
  causes): immutable fields (a workload's ``spec.selector``, a Job's template, a Service's
  cluster IP once allocated, an ``immutable`` ConfigMap's or Secret's data), a selector
  that must match its template's labels, and a ``Recreate`` strategy without
  ``rollingUpdate``.

Each function returns a new object; none mutates its input.
"""

from __future__ import annotations

import copy
import ipaddress
import itertools
from collections.abc import Mapping
from typing import Any

import jsonschema

POD_TEMPLATE_KINDS = {"Deployment", "ReplicaSet", "StatefulSet", "DaemonSet", "Job"}
DEFAULT_MODE = 420  # 0644, the mode of files projected from ConfigMaps and Secrets
_CLUSTER_IPS = (str(ipaddress.IPv4Address("10.96.0.10") + n) for n in itertools.count())


def _probe(probe: dict[str, Any]) -> None:
    for key, value in (("timeoutSeconds", 1), ("periodSeconds", 10), ("successThreshold", 1)):
        probe.setdefault(key, value)
    probe.setdefault("failureThreshold", 3)
    if isinstance(probe.get("httpGet"), dict):
        probe["httpGet"].setdefault("scheme", "HTTP")


def _pull_policy(image: str) -> str:
    tail = image.rsplit("/", 1)[-1]
    if "@" in tail:
        return "IfNotPresent"
    tag = tail.partition(":")[2]
    return "Always" if tag in ("", "latest") else "IfNotPresent"


def _container(container: dict[str, Any]) -> None:
    container.setdefault("terminationMessagePath", "/dev/termination-log")
    container.setdefault("terminationMessagePolicy", "File")
    container.setdefault("imagePullPolicy", _pull_policy(str(container.get("image", ""))))
    container.setdefault("resources", {})
    for port in container.get("ports") or []:
        port.setdefault("protocol", "TCP")
    for env in container.get("env") or []:
        field_ref = (env.get("valueFrom") or {}).get("fieldRef")
        if isinstance(field_ref, dict):
            field_ref.setdefault("apiVersion", "v1")
    for key in ("livenessProbe", "readinessProbe", "startupProbe"):
        if isinstance(container.get(key), dict):
            _probe(container[key])


def _volume(volume: dict[str, Any]) -> None:
    for source in ("configMap", "secret", "downwardAPI", "projected"):
        if isinstance(volume.get(source), dict):
            volume[source].setdefault("defaultMode", DEFAULT_MODE)
    for item in (volume.get("downwardAPI") or {}).get("items") or []:
        if isinstance(item.get("fieldRef"), dict):
            item["fieldRef"].setdefault("apiVersion", "v1")


def pod_spec_defaults(pod: dict[str, Any]) -> None:
    """``SetDefaults_PodSpec`` and its containers, volumes and probes (in place)."""
    pod.setdefault("restartPolicy", "Always")
    pod.setdefault("terminationGracePeriodSeconds", 30)
    pod.setdefault("dnsPolicy", "ClusterFirst")
    pod.setdefault("securityContext", {})
    pod.setdefault("schedulerName", "default-scheduler")
    pod.setdefault("enableServiceLinks", True)
    for key in ("containers", "initContainers"):
        for container in pod.get(key) or []:
            _container(container)
    for volume in pod.get("volumes") or []:
        _volume(volume)


def _deployment(obj: dict[str, Any]) -> None:
    spec = obj.setdefault("spec", {})
    spec.setdefault("replicas", 1)
    strategy = spec.setdefault("strategy", {})
    strategy.setdefault("type", "RollingUpdate")
    if strategy["type"] == "RollingUpdate":
        rolling = strategy.setdefault("rollingUpdate", {})
        rolling.setdefault("maxUnavailable", "25%")
        rolling.setdefault("maxSurge", "25%")
    spec.setdefault("revisionHistoryLimit", 10)
    spec.setdefault("progressDeadlineSeconds", 600)


def allocate_cluster_ip(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A new Service with its cluster IP allocated (as on create); other objects unchanged."""
    out = copy.deepcopy(dict(obj))
    spec = out.get("spec")
    if out.get("kind") == "Service" and isinstance(spec, dict) and spec.get("type") != "ExternalName":
        if "clusterIP" not in spec:
            spec["clusterIP"] = next(_CLUSTER_IPS)
        spec.setdefault("clusterIPs", [spec["clusterIP"]])
        spec.setdefault("ipFamilies", ["IPv4"])
        spec.setdefault("ipFamilyPolicy", "SingleStack")
    return out


def _service(obj: dict[str, Any]) -> None:
    spec = obj.setdefault("spec", {})
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    spec.setdefault("internalTrafficPolicy", "Cluster")
    for port in spec.get("ports") or []:
        port.setdefault("protocol", "TCP")
        port.setdefault("targetPort", port.get("port"))


def _network_policy(obj: dict[str, Any]) -> None:
    spec = obj.setdefault("spec", {})
    if "policyTypes" not in spec:
        spec["policyTypes"] = ["Ingress"] + (["Egress"] if spec.get("egress") else [])
    for direction in ("ingress", "egress"):
        for rule in spec.get(direction) or []:
            for port in rule.get("ports") or []:
                port.setdefault("protocol", "TCP")


_BUILTIN = {"Deployment": _deployment, "Service": _service, "NetworkPolicy": _network_policy}


def builtin_defaults(obj: Mapping[str, Any]) -> dict[str, Any]:
    """``obj`` with the defaults the API server gives its kind (idempotent)."""
    out = copy.deepcopy(dict(obj))
    kind = out.get("kind")
    if kind in _BUILTIN:
        _BUILTIN[kind](out)
    if kind in POD_TEMPLATE_KINDS:
        pod_spec_defaults(out.setdefault("spec", {}).setdefault("template", {}).setdefault("spec", {}))
    return out


def structural(value: Any, schema: Mapping[str, Any]) -> Any:
    """``value`` pruned to ``schema`` (unknown fields dropped) with its defaults applied."""
    if isinstance(value, dict) and schema.get("type") == "object":
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return copy.deepcopy(value)
        properties = schema.get("properties")
        if properties is not None:
            out = {k: structural(v, properties[k]) for k, v in value.items() if k in properties}
            for name, sub in properties.items():
                if name not in out and "default" in sub:
                    out[name] = copy.deepcopy(sub["default"])
            return out
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            return {k: structural(v, extra) for k, v in value.items()}
        return copy.deepcopy(value)
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [structural(item, schema["items"]) for item in value]
    return copy.deepcopy(value)


def custom_resource_defaults(obj: Mapping[str, Any], schema: Mapping[str, Any]) -> dict[str, Any]:
    """A custom resource pruned and defaulted by its CRD's ``openAPIV3Schema``.

    ``apiVersion``, ``kind`` and ``metadata`` are the server's own and never pruned.
    """
    out = copy.deepcopy(dict(obj))
    properties = schema.get("properties") or {}
    for key in list(out):
        if key in ("apiVersion", "kind", "metadata"):
            continue
        if key not in properties:
            del out[key]
        else:
            out[key] = structural(out[key], properties[key])
    return out


def _draft4(schema: Any) -> Any:
    """An OpenAPI v3 schema as JSON Schema draft 4 (``nullable``, ``x-kubernetes-int-or-string``)."""
    if isinstance(schema, list):
        return [_draft4(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _draft4(value) if key != "default" else value for key, value in schema.items()}
    if schema.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if schema.get("nullable") and "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = [*types, "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


def schema_validator(schema: Mapping[str, Any]) -> jsonschema.Draft4Validator:
    """A validator of custom resources by their CRD's ``openAPIV3Schema``."""
    return jsonschema.Draft4Validator(_draft4(dict(schema)))


def schema_problems(obj: Mapping[str, Any], validator: jsonschema.Draft4Validator) -> list[str]:
    """Where a custom resource breaks its schema, as the API server's 422 lists them."""
    body = {key: value for key, value in obj.items() if key != "metadata"}
    return sorted(
        f"{'.'.join(str(part) for part in error.absolute_path) or '<root>'}: {error.message}"
        for error in validator.iter_errors(body)
    )


def spec_of(obj: Mapping[str, Any]) -> Any:
    """What ``generation`` tracks: everything but metadata and status (the spec, a ConfigMap's data)."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


def stale(current: Mapping[str, Any], write: Mapping[str, Any] | None) -> str | None:
    """Why a write's ``metadata.resourceVersion`` (or a delete's ``preconditions``) is stale."""
    if not isinstance(write, Mapping):
        return None
    meta = current.get("metadata") or {}
    wanted = dict(write.get("preconditions") or {})
    for key in ("uid", "resourceVersion"):
        value = (write.get("metadata") or {}).get(key)
        if value is not None:
            wanted[key] = value
    for key, value in wanted.items():
        if value is not None and meta.get(key) != value:
            return f"precondition failed: {key} {value!r} is not the object's {meta.get(key)!r}"
    return None


def _requirement(term: str) -> tuple[str, str, str | None]:
    term = term.strip()
    if "!=" in term:
        key, _, value = term.partition("!=")
        return key.strip(), "!=", value.strip()
    if "==" in term or "=" in term:
        key, _, value = term.replace("==", "=").partition("=")
        return key.strip(), "=", value.strip()
    if term.startswith("!"):
        return term[1:].strip(), "!", None
    return term, "exists", None


def selects(selector: str | None, labels: Mapping[str, str] | None) -> bool:
    """Whether an equality-based ``labelSelector`` (``a=b,c!=d,e,!f``) selects ``labels``."""
    labels = labels or {}
    for term in filter(None, (selector or "").split(",")):
        key, op, value = _requirement(term)
        if op == "=" and labels.get(key) != value:
            return False
        if op == "!=" and labels.get(key) == value:
            return False
        if op == "exists" and key not in labels:
            return False
        if op == "!" and key in labels:
            return False
    return True


def merge_patch(obj: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """RFC 7386, as the API server applies ``application/merge-patch+json``."""
    out = copy.deepcopy(dict(obj))
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping):
            base = out.get(key)
            out[key] = merge_patch(base if isinstance(base, Mapping) else {}, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch from ``old`` to ``new`` (how the emulator stores a computed object)."""
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            sub = changes(before, value)
            if sub:
                patch[key] = sub
        elif key not in old or before != value:
            patch[key] = copy.deepcopy(value)
    return patch


# Validation on write: what a real API server refuses with 422 Invalid.

SELECTED_KINDS = frozenset({"Deployment", "ReplicaSet", "DaemonSet", "StatefulSet"})
# A Job's spec fields fixed at creation (batch/v1 ValidateJobUpdate; the template's few
# mutable fields of a suspended Job aside).
JOB_IMMUTABLE = ("selector", "template", "completionMode")


def cause(field: str, message: str, reason: str = "FieldValueInvalid") -> dict[str, str]:
    """One of a 422's ``details.causes``, as a real API server words it."""
    return {"reason": reason, "message": message, "field": field}


def _get(obj: Mapping[str, Any], path: str) -> Any:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def _immutable(
    stored: Mapping[str, Any], after: Mapping[str, Any], path: str, why: str
) -> list[dict[str, str]]:
    """The cause for ``path`` if the update changes it; none otherwise."""
    if _get(stored, path) == _get(after, path):
        return []
    return [cause(path, f"Invalid value: {_get(after, path)!r}: {why}")]


def _needs_cluster_ip(obj: Mapping[str, Any]) -> bool:
    return obj.get("kind") == "Service" and (obj.get("spec") or {}).get("type") != "ExternalName"


def keep_allocated(stored: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """An updated Service keeps the cluster IP it was allocated where the write left it out
    (a real server refills ``clusterIP``, ``clusterIPs`` and the IP families); others unchanged."""
    out = copy.deepcopy(dict(after))
    if not (_needs_cluster_ip(stored) and _needs_cluster_ip(out)):
        return out
    spec, before = out.setdefault("spec", {}), stored.get("spec") or {}
    for key in ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy"):
        if spec.get(key) in (None, "", []) and key in before:
            spec[key] = copy.deepcopy(before[key])
    return out


def _requirement_holds(expression: Mapping[str, Any], labels: Mapping[str, Any]) -> bool:
    key, values = expression.get("key"), expression.get("values") or []
    return {
        "In": key in labels and labels[key] in values,
        "NotIn": key not in labels or labels[key] not in values,
        "Exists": key in labels,
        "DoesNotExist": key not in labels,
    }.get(str(expression.get("operator")), False)


def selector_matches(selector: Any, labels: Mapping[str, Any] | None) -> bool:
    """Whether a ``LabelSelector`` (``matchLabels``, ``matchExpressions``) selects ``labels``."""
    labels = labels or {}
    if not isinstance(selector, Mapping):
        return True
    match = selector.get("matchLabels") or {}
    return all(labels.get(key) == value for key, value in match.items()) and all(
        _requirement_holds(expression, labels) for expression in selector.get("matchExpressions") or []
    )


def object_problems(obj: Mapping[str, Any]) -> list[dict[str, str]]:
    """Why a real API server refuses ``obj`` on any write (its validation; empty: none)."""
    kind, spec = obj.get("kind"), obj.get("spec") or {}
    out = []
    labels = _get(spec, "template.metadata.labels")
    if kind in SELECTED_KINDS and not selector_matches(spec.get("selector"), labels):
        message = f"Invalid value: {labels!r}: `selector` does not match template `labels`"
        out.append(cause("spec.template.metadata.labels", message))
    strategy = spec.get("strategy") or {}
    if kind == "Deployment" and strategy.get("type") == "Recreate" and "rollingUpdate" in strategy:
        message = "Forbidden: may not be specified when strategy `type` is 'Recreate'"
        out.append(cause("spec.strategy.rollingUpdate", message, "FieldValueForbidden"))
    return out


def update_problems(stored: Mapping[str, Any], after: Mapping[str, Any]) -> list[dict[str, str]]:
    """Which immutable fields an update of ``stored`` into ``after`` changes (empty: none)."""
    kind = stored.get("kind")
    out = []
    if kind in SELECTED_KINDS:
        out += _immutable(stored, after, "spec.selector", "field is immutable")
    if kind == "Job":
        for key in JOB_IMMUTABLE:
            out += _immutable(stored, after, f"spec.{key}", "field is immutable")
    if kind == "Service" and _needs_cluster_ip(stored) and _needs_cluster_ip(after):
        for key in ("clusterIP", "clusterIPs"):
            out += _immutable(stored, after, f"spec.{key}", "may not change once set")
    if kind in ("ConfigMap", "Secret") and stored.get("immutable") is True:
        for key in ("data", "binaryData", "immutable"):
            if stored.get(key) != after.get(key):
                message = "Forbidden: field is immutable when `immutable` is set"
                out.append(cause(key, message, "FieldValueForbidden"))
    return out


def invalid_message(obj: Mapping[str, Any], causes: list[dict[str, str]]) -> str:
    """A 422's message: ``Kind.group "name" is invalid: field: message, ...``."""
    group = str(obj.get("apiVersion", "")).rpartition("/")[0]
    kind = f"{obj.get('kind')}.{group}" if group else str(obj.get("kind"))
    name = (obj.get("metadata") or {}).get("name")
    return f'{kind} "{name}" is invalid: ' + ", ".join(f"{c['field']}: {c['message']}" for c in causes)
