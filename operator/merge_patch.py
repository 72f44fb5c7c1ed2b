"""JSON merge patches (RFC 7386) and stable digests of JSON-like values."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any


def canonical_json(value: Any) -> str:
    """Compact JSON with sorted keys: equal values give equal strings."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def digest(value: Any, length: int = 16) -> str:
    """A short stable hex digest of a JSON-like value."""
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()[:length]


def diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that turns ``old`` into ``new`` (empty when they are equal).

    Mappings are compared key by key (a removed key becomes ``None``); any other
    value, lists included, is replaced as a whole when it differs.
    """
    patch: dict[str, Any] = {}
    for key in old:
        if key not in new:
            patch[key] = None
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            sub = diff(before, value)
            if sub:
                patch[key] = sub
        elif key not in old or before != value:
            patch[key] = value
    return patch


def overlay(last: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """A merge patch that sets all of ``desired`` and removes what only ``last`` had.

    Like ``kubectl apply``: ``last`` is the previously applied state, so fields the
    operator stopped setting are removed while fields set by others survive.
    """
    patch: dict[str, Any] = {}
    for key, value in desired.items():
        before = last.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            patch[key] = overlay(before, value)
        else:
            patch[key] = value
    for key in last:
        if key not in desired:
            patch[key] = None
    return patch


def apply_merge_patch(obj: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """``obj`` with a merge patch applied, as the API server does (pure; for tests and emulators)."""
    result = dict(obj)
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            result[key] = apply_merge_patch(result[key], value)
        elif isinstance(value, Mapping):
            result[key] = apply_merge_patch({}, value)
        else:
            result[key] = value
    return result
