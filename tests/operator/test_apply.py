"""Apply compares a child field by field on what the operator sets (pure)."""

from __future__ import annotations

import copy
import json

from kvpool.operator import names
from kvpool.operator.kube import changed_fields, desired_patch, with_last_applied
from kvpool.operator.merge_patch import apply_merge_patch
from kvpool.operator.plan import build_plan
from testing.operator_objects import pool_spec, stored


def live_of(child: dict) -> dict:
    """``child`` as applied and stored by the API server (its defaults, its metadata)."""
    applied, _ = with_last_applied(child)
    live = stored(applied)
    live["metadata"].update(uid="u1", resourceVersion="7", generation=1)
    return live


def children() -> dict[str, dict]:
    return {
        f"{c['kind']}/{c['metadata']['name']}": c
        for c in build_plan(
            "pool", "team-a", pool_spec(master={"resources": {"requests": {"cpu": "0.5"}}})
        ).children
    }


def test_server_defaults_and_equal_quantities_are_no_change() -> None:
    for child in children().values():
        live = live_of(child)
        assert changed_fields(live, child) == [], child["metadata"]["name"]
    master = live_of(children()["Deployment/pool-master"])
    master["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "500m"
    assert desired_patch(master, children()["Deployment/pool-master"]) == {}


def test_a_record_written_by_another_release_is_no_change() -> None:
    """An upgrade whose rendering adds a field the server already holds (here: a default)
    writes nothing; the last-applied record is no reason to write."""
    store = children()["Deployment/pool-store"]
    live = live_of(store)
    newer = copy.deepcopy(store)
    newer["spec"]["revisionHistoryLimit"] = 10  # what the server defaulted already
    assert desired_patch(live, newer) == {}


def test_hand_edits_of_owned_fields_are_changes() -> None:
    store = children()["Deployment/pool-store"]
    live = live_of(store)
    live["spec"]["replicas"] = 0
    assert changed_fields(live, store) == ["spec.replicas"]
    assert apply_merge_patch(live, desired_patch(live, store))["spec"]["replicas"] == 2

    policy = children()["NetworkPolicy/pool-kvpool"]
    live = live_of(policy)
    live["spec"]["ingress"].append({})
    live["spec"]["podSelector"]["matchLabels"]["extra"] = "x"
    assert set(changed_fields(live, policy)) == {"spec.ingress", "spec.podSelector.matchLabels.extra"}
    assert apply_merge_patch(live, desired_patch(live, policy))["spec"] == stored(policy)["spec"]


def test_others_fields_stay_and_dropped_fields_go() -> None:
    master = children()["Deployment/pool-master"]
    live = live_of(master)
    live["spec"]["template"]["metadata"]["annotations"] = {"kubectl.kubernetes.io/restartedAt": "now"}
    live["metadata"]["labels"]["team"] = "a"
    assert changed_fields(live, master) == []
    # A field the operator set before and no longer sets is removed.
    record = json.loads(live["metadata"]["annotations"][names.ANNOTATION_LAST_APPLIED])
    record["spec"]["minReadySeconds"] = 5
    live["metadata"]["annotations"][names.ANNOTATION_LAST_APPLIED] = json.dumps(record)
    live["spec"]["minReadySeconds"] = 5
    assert changed_fields(live, master) == ["spec.minReadySeconds"]
    assert "minReadySeconds" not in apply_merge_patch(live, desired_patch(live, master))["spec"]
