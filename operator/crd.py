"""The ``MooncakeKVPool`` and ``MooncakeKVPoolGrant`` CustomResourceDefinitions, generated
from the pydantic models.

Pydantic's JSON Schema becomes a Kubernetes structural OpenAPI v3 schema: references
inlined, ``anyOf`` with null turned into ``nullable``, int-or-string marked as such,
numeric bounds in OpenAPI 3.0 form, and keywords Kubernetes rejects dropped.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel

from kvpool.operator.names import (
    GRANT_SHORT_NAMES,
    GRANT_SINGULAR,
    GRANTS,
    POOL_SHORT_NAMES,
    POOL_SINGULAR,
    POOLS,
    ApiResource,
)
from kvpool.operator.spec import (
    CONFLICT,
    DEGRADED,
    OBSERVED,
    GrantSpec,
    GrantStatus,
    PoolSpec,
    PoolStatus,
)

_DROPPED = {"title", "$defs", "uniqueItems", "examples"}
_BOUNDS = {
    "ge": ("minimum", False),
    "gt": ("minimum", True),
    "le": ("maximum", False),
    "lt": ("maximum", True),
}


def openapi_schema(model: type[BaseModel], mode: str = "validation") -> dict[str, Any]:
    """A structural OpenAPI v3 schema of ``model`` (camelCase aliases)."""
    raw = model.model_json_schema(by_alias=True, mode=mode)  # type: ignore[arg-type]
    return _convert(raw, raw.get("$defs", {}))


def _convert(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _convert(merged, defs)
    if "anyOf" in node:
        return _convert_any_of(node, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED or (key == "additionalProperties" and value is False):
            continue
        if key in _BOUNDS or key in ("exclusiveMinimum", "exclusiveMaximum"):
            _convert_bound(key, value, out)
        elif key == "const":
            out["enum"] = [value]
        elif key == "properties":
            out[key] = {name: _convert(sub, defs) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _convert(value, defs)
        elif key == "default":
            if value is not None and not isinstance(value, dict | list):
                out[key] = value
        else:
            out[key] = value
    return out


def _convert_bound(key: str, value: Any, out: dict[str, Any]) -> None:
    if key == "exclusiveMinimum":
        out["minimum"], out["exclusiveMinimum"] = value, True
    elif key == "exclusiveMaximum":
        out["maximum"], out["exclusiveMaximum"] = value, True
    else:
        name, exclusive = _BOUNDS[key]
        out[name] = value
        if exclusive:
            out[f"exclusive{name.capitalize()}"] = True


def _convert_any_of(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    variants = [v for v in node["anyOf"] if v != {"type": "null"}]
    nullable = len(variants) < len(node["anyOf"])
    rest = {k: v for k, v in node.items() if k != "anyOf"}
    converted = [_convert(v, defs) for v in variants]
    types = {v.get("type") for v in converted}
    if len(converted) == 1:
        out = {**converted[0], **_convert(rest, defs)}
    elif types == {"integer", "string"}:
        out = {"x-kubernetes-int-or-string": True, **_convert(rest, defs)}
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            out.pop(key, None)
    else:
        raise ValueError(f"cannot express anyOf {node['anyOf']!r} in a structural schema")
    if nullable:
        out["nullable"] = True
    return out


def _condition_column(kind: str) -> dict[str, Any]:
    return {
        "name": kind,
        "type": "string",
        "jsonPath": f'.status.conditions[?(@.type=="{kind}")].status',
        "priority": 1 if kind != "ConfigValid" else 0,
    }


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition manifest."""
    schema = {
        "type": "object",
        "description": "A Mooncake KV-cache pool shared by vLLM Deployments.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": openapi_schema(PoolSpec),
            "status": openapi_schema(PoolStatus, mode="serialization"),
        },
    }
    columns = [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        _condition_column("ConfigValid"),
        _condition_column("MasterReady"),
        _condition_column("StoreReady"),
        _condition_column("ConsumersRolledOut"),
        _condition_column(CONFLICT),
        _condition_column(OBSERVED),
        _condition_column(DEGRADED),
        # What the master itself counts (status.capacity): memory, use, objects, stores.
        {"name": "Capacity", "type": "string", "jsonPath": ".status.capacity.capacity"},
        {"name": "Used", "type": "string", "jsonPath": ".status.capacity.used"},
        {"name": "Objects", "type": "integer", "jsonPath": ".status.capacity.objects"},
        {"name": "Stores", "type": "string", "jsonPath": ".status.capacity.stores"},
        # What the consumers themselves count (status.hits).
        {"name": "Hit rate", "type": "string", "jsonPath": ".status.hits.hitRate"},
        {"name": "Store drain", "type": "string", "jsonPath": ".status.storeDrain.state"},
        {"name": "Evictions", "type": "integer", "jsonPath": ".status.capacity.evictions", "priority": 1},
        {"name": "Master", "type": "string", "jsonPath": ".status.masterAddress", "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return _definition(POOLS, POOL_SINGULAR, POOL_SHORT_NAMES, schema, columns)


def build_grant_crd() -> dict[str, Any]:
    """The ``MooncakeKVPoolGrant`` CustomResourceDefinition manifest."""
    schema = {
        "type": "object",
        "description": "A share of a MooncakeKVPool for this namespace: one Mooncake tenant with a "
        "memory ceiling the pool's master enforces.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": openapi_schema(GrantSpec),
            "status": openapi_schema(GrantStatus, mode="serialization"),
        },
    }
    columns = [
        {"name": "Pool", "type": "string", "jsonPath": ".spec.pool"},
        {"name": "Ceiling", "type": "string", "jsonPath": ".spec.ceiling"},
        {"name": "Granted", "type": "string", "jsonPath": ".status.ceiling"},
        # What the master charges the grant's tenant, of the quota it enforces ('unknown': not observed).
        {"name": "Used", "type": "string", "jsonPath": ".status.usage.used"},
        _condition_column("Accepted") | {"priority": 0},
        _condition_column("Cut") | {"priority": 0},
        {"name": "Tenant", "type": "string", "jsonPath": ".status.tenant", "priority": 1},
        {"name": "Rejected", "type": "integer", "jsonPath": ".status.usage.rejectedWrites", "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return _definition(GRANTS, GRANT_SINGULAR, GRANT_SHORT_NAMES, schema, columns)


def _definition(
    resource: ApiResource,
    singular: str,
    short_names: tuple[str, ...],
    schema: dict[str, Any],
    columns: list[dict[str, Any]],
) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{resource.plural}.{resource.group}"},
        "spec": {
            "group": resource.group,
            "names": {
                "kind": resource.kind,
                "listKind": f"{resource.kind}List",
                "plural": resource.plural,
                "singular": singular,
                "shortNames": list(short_names),
                "categories": ["mooncake"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": resource.version,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": columns,
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


class _Dumper(yaml.SafeDumper):
    """Plain YAML: no anchors or aliases for repeated values."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render_crd(crd: dict[str, Any] | None = None, command: str = "kvpool-operator crd") -> str:
    """A CRD (the pool's by default) as YAML, exactly as the chart ships it (``command`` prints it)."""
    header = f"# Generated by `{command}`; do not edit by hand.\n"
    body = yaml.dump(crd or build_crd(), Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True)
    return header + body
