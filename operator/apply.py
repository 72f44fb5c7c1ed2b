"""Bring the pool's own children to their desired state, writing only when it differs.

Each child carries the JSON it was last applied with (an annotation). Equal JSON means
no write; otherwise a merge patch sets the desired state and removes the fields the
operator stopped setting (the ``kubectl apply`` way), leaving others' fields alone.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from kvpool.operator.kube import ApiError, Kube
from kvpool.operator.names import ANNOTATION_LAST_APPLIED
from kvpool.operator.patching import canonical_json, overlay
from kvpool.operator.resources import Resource, resource_of


def with_last_applied(obj: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """``obj`` annotated with its own canonical JSON, and that JSON."""
    desired = copy.deepcopy(dict(obj))
    annotations = desired.setdefault("metadata", {}).setdefault("annotations", {})
    annotations.pop(ANNOTATION_LAST_APPLIED, None)
    applied = canonical_json(desired)
    annotations[ANNOTATION_LAST_APPLIED] = applied
    return desired, applied


def last_applied(live: Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """The annotation on a live object, raw and parsed (``{}`` when absent or broken)."""
    raw = (live.get("metadata", {}).get("annotations") or {}).get(ANNOTATION_LAST_APPLIED)
    try:
        parsed = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        parsed = {}
    return raw, parsed if isinstance(parsed, dict) else {}


def apply_patch(live: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch from ``live`` to ``desired``; empty when already applied."""
    desired, applied = with_last_applied(desired)
    raw, previous = last_applied(live)
    if raw == applied:
        return {}
    return overlay(previous, desired)


async def ensure(kube: Kube, obj: Mapping[str, Any]) -> dict[str, Any]:
    """Create or patch ``obj``; the live object afterwards."""
    resource = resource_of(dict(obj))
    namespace, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    live = await kube.get(resource, namespace, name)
    if live is None:
        desired, _ = with_last_applied(obj)
        try:
            return await kube.create(resource, namespace, desired)
        except ApiError as exc:
            if not exc.conflict:
                raise
            live = await kube.get(resource, namespace, name)
            if live is None:
                raise
    patch = apply_patch(live, obj)
    if not patch:
        return live
    return await kube.patch(resource, namespace, name, patch)


async def ensure_absent(kube: Kube, resource: Resource, namespace: str, name: str) -> bool:
    """Delete the object if it exists; whether a delete was sent and succeeded."""
    if await kube.get(resource, namespace, name) is None:
        return False
    return await kube.delete(resource, namespace, name)
