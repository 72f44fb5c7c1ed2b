"""Least privilege, proven on the operator's real traffic.

The operator's integration scenarios (tests/operator: the real operator, kopf and all,
against kmock) run twice — cluster-wide, and watching one namespace as the chart runs it
with ``clusterWide=false`` — and every API request the operator made is recorded
(``conftest.recordings``). Each must be allowed by the chart's rendered rules in that mode,
and every verb on every resource the chart grants must have been used.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvpool.operator.generated import RBAC_RULES_PATH
from kvpool.operator.rbac import RULES, Permission, request_permission
from tests.chart.conftest import Recording, Request
from tests.chart.helm import CHART, NAMESPACE, ROOT, Helm, of_kind, one

# Discovery: readable by every authenticated user (the default system:discovery ClusterRole).
DISCOVERY = re.compile(r"^/(api|apis)(/v1|/[a-z0-9.-]+/v[0-9a-z]+)?/?$")


@dataclass(frozen=True)
class Grant:
    """One (group, resource, verb) a rule grants, and where: None is every namespace."""

    api_group: str
    resource: str
    verb: str
    namespace: str | None


def grants(rules: Iterable[dict[str, Any]], namespace: str | None) -> set[Grant]:
    return {
        Grant(group, resource, verb, namespace)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def rendered_grants(objects: list[dict[str, Any]]) -> set[Grant]:
    """What the chart gives its ServiceAccount: roles resolved through their bindings."""
    account = one(objects, "ServiceAccount")["metadata"]
    subject = {"kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]}
    roles = {("ClusterRole", r["metadata"]["name"], None): r for r in of_kind(objects, "ClusterRole")}
    roles |= {
        ("Role", r["metadata"]["name"], r["metadata"]["namespace"]): r for r in of_kind(objects, "Role")
    }
    out: set[Grant] = set()
    for binding in of_kind(objects, "ClusterRoleBinding") + of_kind(objects, "RoleBinding"):
        assert binding["subjects"] == [subject], binding["metadata"]["name"]
        ref = binding["roleRef"]
        assert ref["apiGroup"] == "rbac.authorization.k8s.io"
        where = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
        role = roles[(ref["kind"], ref["name"], where if ref["kind"] == "Role" else None)]
        out |= grants(role["rules"], where)
    return out


def needed(request: Request) -> tuple[Permission | None, str | None]:
    path = urlsplit(request.url).path
    permission = request_permission(request.method, request.url)
    # ".../namespaces/<ns>/<plural>..." is namespaced; a plain list or watch is cluster-wide.
    segments = [s for s in path.split("/") if s]
    namespace = None
    if "namespaces" in segments:
        index = segments.index("namespaces")
        if len(segments) > index + 2:
            namespace = segments[index + 1]
    return permission, namespace


def allows(grant: Grant, permission: Permission, namespace: str | None) -> bool:
    return (grant.api_group, grant.resource, grant.verb) == (
        permission.api_group,
        permission.resource,
        permission.verb,
    ) and (grant.namespace is None or grant.namespace == namespace)


def check(recording: Recording, granted: set[Grant]) -> None:
    refused, used = [], set()
    for request in recording.requests:
        permission, namespace = needed(request)
        if permission is None:
            assert request.method == "GET" and DISCOVERY.match(urlsplit(request.url).path), request
            continue
        for wanted in [permission, *(Permission(*p) for p in request.implied)]:
            granting = [g for g in granted if allows(g, wanted, namespace)]
            if not granting:
                refused.append(f"{request.method} {urlsplit(request.url).path} {wanted} ({request.test})")
            used.update(granting)
    assert not refused, "requests the chart's RBAC refuses:\n" + "\n".join(sorted(set(refused)))
    assert granted - used == set(), f"granted but never used: {sorted(granted - used, key=str)}"


@pytest.fixture(scope="module")
def cluster_objects(helm: Helm) -> list[dict[str, Any]]:
    return helm.template()


@pytest.fixture(scope="module")
def namespaced_objects(helm: Helm, recordings: dict[str, Recording]) -> list[dict[str, Any]]:
    (watched,) = recordings["namespaced"].namespaces
    return helm.template(sets=["clusterWide=false", f"watchNamespaces[0]={watched}"])


def test_the_scenarios_ran_in_both_modes(recordings: dict[str, Recording]) -> None:
    for mode in ("cluster", "namespaced"):
        recording = recordings[mode]
        assert len(recording.tests) >= 5, (mode, recording.tests)
        assert len(recording.requests) > 100
        writes = {r.method for r in recording.requests}
        assert {"GET", "POST", "PATCH", "DELETE"} <= writes


def test_cluster_wide_rbac_allows_every_request_and_no_more(
    cluster_objects: list[dict[str, Any]], recordings: dict[str, Recording]
) -> None:
    assert of_kind(cluster_objects, "Role") == of_kind(cluster_objects, "RoleBinding") == []
    granted = rendered_grants(cluster_objects)
    assert granted and all(g.namespace is None for g in granted)
    check(recordings["cluster"], granted)


def test_namespaced_rbac_allows_every_request_and_no_more(
    namespaced_objects: list[dict[str, Any]], recordings: dict[str, Recording]
) -> None:
    objects = namespaced_objects
    assert of_kind(objects, "ClusterRole") == of_kind(objects, "ClusterRoleBinding") == []
    granted = rendered_grants(objects)
    assert {g.namespace for g in granted} == set(recordings["namespaced"].namespaces)
    check(recordings["namespaced"], granted)
    # ...and the cluster-wide traffic (all-namespace lists and watches) would be refused.
    with pytest.raises(AssertionError, match="refuses"):
        check(recordings["cluster"], granted)


def test_the_rules_are_the_operators_own(cluster_objects: list[dict[str, Any]]) -> None:
    """The chart grants exactly ``kvpool-operator rbac`` (kvpool.operator.rbac.RULES)."""
    (role,) = of_kind(cluster_objects, "ClusterRole")
    assert grants(role["rules"], None) == grants((r.as_dict() for r in RULES), None)


def test_a_missing_rules_file_fails_the_render(helm: Helm, chart_copy: Path) -> None:
    (chart_copy / (ROOT / RBAC_RULES_PATH).relative_to(CHART)).unlink()
    with pytest.raises(AssertionError, match="is missing or empty"):
        helm.template(chart=chart_copy)


def test_no_wildcards_and_no_secrets(helm: Helm) -> None:
    for sets in ([], ["clusterWide=false", "watchNamespaces={a,b}"]):
        objects = helm.template(sets=sets)
        for role in of_kind(objects, "ClusterRole") + of_kind(objects, "Role"):
            for rule in role["rules"]:
                for key in ("apiGroups", "resources", "verbs"):
                    assert "*" not in rule[key], (role["metadata"]["name"], rule)
                assert "secrets" not in rule["resources"]
                assert "resourceNames" not in rule and "nonResourceURLs" not in rule


def test_namespaced_mode_binds_a_role_in_each_watched_namespace(helm: Helm) -> None:
    objects = helm.template(sets=["clusterWide=false", "watchNamespaces={team-a,team-b,team-a}"])
    assert sorted(r["metadata"]["namespace"] for r in of_kind(objects, "Role")) == ["team-a", "team-b"]
    assert sorted(r["metadata"]["namespace"] for r in of_kind(objects, "RoleBinding")) == ["team-a", "team-b"]
    default = helm.template(sets=["clusterWide=false"])
    assert [r["metadata"]["namespace"] for r in of_kind(default, "Role")] == [NAMESPACE]


def test_rbac_and_account_can_be_left_out(helm: Helm) -> None:
    objects = helm.template(
        sets=["rbac.create=false", "serviceAccount.create=false", "serviceAccount.name=ops"]
    )
    kinds = {o["kind"] for o in objects}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ServiceAccount"}
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops"


def test_the_proof_bites(cluster_objects: list[dict[str, Any]], recordings: dict[str, Recording]) -> None:
    granted = rendered_grants(cluster_objects)
    fewer = {g for g in granted if (g.resource, g.verb) != ("deployments", "patch")}
    with pytest.raises(AssertionError, match="refuses"):
        check(recordings["cluster"], fewer)
    with pytest.raises(AssertionError, match="never used"):
        check(recordings["cluster"], granted | {Grant("", "secrets", "get", None)})
