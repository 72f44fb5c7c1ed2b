"""Merge patches and digests."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.operator.merge_patch import apply_merge_patch, canonical_json, diff, digest, overlay

scalars = st.one_of(st.integers(-3, 3), st.text("ab", max_size=2), st.booleans())
json_values = st.recursive(
    scalars | st.lists(scalars, max_size=3),
    lambda children: st.dictionaries(st.sampled_from("abcd"), children, max_size=3),
    max_leaves=12,
)
objects = st.dictionaries(st.sampled_from("abcd"), json_values, max_size=4)


@settings(max_examples=200, deadline=None)
@given(old=objects, new=objects)
def test_diff_turns_old_into_new(old: dict[str, Any], new: dict[str, Any]) -> None:
    assert apply_merge_patch(old, diff(old, new)) == new
    assert (diff(old, new) == {}) == (old == new)


@settings(max_examples=200, deadline=None)
@given(last=objects, desired=objects, foreign=objects)
def test_overlay_sets_desired_and_keeps_foreign_fields(
    last: dict[str, Any], desired: dict[str, Any], foreign: dict[str, Any]
) -> None:
    live = apply_merge_patch(foreign, last)  # someone else's fields plus what was applied last time
    result = apply_merge_patch(live, overlay(last, desired))
    # Everything desired is there.
    assert apply_merge_patch(result, desired) == result
    # A top-level key nobody applied survives.
    for key, value in foreign.items():
        if key not in last and key not in desired:
            assert result[key] == value


def test_digest_is_stable_and_order_free() -> None:
    assert canonical_json({"b": 1, "a": [1, 2]}) == '{"a":[1,2],"b":1}'
    assert digest({"a": 1, "b": 2}) == digest({"b": 2, "a": 1})
    assert digest({"a": 1}) != digest({"a": 2})
    assert len(digest({})) == 16
