"""Least privilege, proven on the operator's real traffic.

The operator's integration scenarios (tests/operator: the real operator, kopf and all,
against kmock) run twice — cluster-wide, and watching one namespace as the chart runs it
with ``clusterWide=false`` — and every API request the operator made is recorded
(``conftest.recordings``). Each must be allowed by the chart's rendered rules in that mode,
and every verb on every resource the chart grants must have been used. In namespaced mode the
Roles alone must allow them: the one right the chart grants there cluster-wide (``patch`` on
pools, to remove a finalizer once a namespace's Role is gone: test_chart_namespace_deletion)
is never what the operator's other requests rely on.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvpool.operator.generated import FINALIZER_RULES_PATH, RBAC_RULES_PATH
from kvpool.operator.names import POOLS
from kvpool.operator.rbac import FINALIZER_RULES, RULES, Permission
from tests.chart.conftest import Recording
from tests.chart.grants import Grant, allows, grants, needed_by, rendered_grants
from tests.chart.helm import CHART, NAMESPACE, ROOT, Helm, of_kind, one

# Discovery: readable by every authenticated user (the default system:discovery ClusterRole).
DISCOVERY = re.compile(r"^/(api|apis)(/v1|/[a-z0-9.-]+/v[0-9a-z]+)?/?$")


def check(recording: Recording, granted: set[Grant]) -> None:
    refused, used = [], set()
    for request in recording.requests:
        permission, namespace = needed_by(request.method, request.url)
        if permission is None:
            assert request.method == "GET" and DISCOVERY.match(urlsplit(request.url).path), request
            continue
        for wanted in [permission, *(Permission(*p) for p in request.implied)]:
            granting = [g for g in granted if allows(g, wanted, namespace)]
            if not granting:
                refused.append(f"{request.method} {urlsplit(request.url).path} {wanted} ({request.test})")
            used.update(granting)
    assert not refused, "requests the chart's RBAC refuses:\n" + "\n".join(sorted(set(refused)))

    # One rule list, bound in every watched namespace: each rule is used in one of them.
    def rule(grant: Grant) -> tuple[str, str, str]:
        return (grant.api_group, grant.resource, grant.verb)

    unused = {rule(g) for g in granted} - {rule(g) for g in used}
    assert unused == set(), f"granted but never used: {sorted(unused)}"


AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"
FINALIZERS = "kvpool-mooncake-kvpool-finalizers"  # namespaced mode's one cluster-wide role
# What it grants: patch on pools, in every namespace.
FINALIZER_GRANT = Grant(POOLS.group, POOLS.plural, "patch", None)


def operator_roles(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The (Cluster)Roles of ``kind`` but the tenants' aggregated ones."""
    return [
        o for o in of_kind(objects, kind) if not any(k.startswith(AGGREGATE) for k in o["metadata"]["labels"])
    ]


@pytest.fixture(scope="module")
def cluster_objects(helm: Helm) -> list[dict[str, Any]]:
    return helm.template(sets=["clusterWide=true"])


@pytest.fixture(scope="module")
def namespaced_objects(helm: Helm, recordings: dict[str, Recording]) -> list[dict[str, Any]]:
    watched = recordings["namespaced"].namespaces
    return helm.template(sets=[f"watchNamespaces[{i}]={namespace}" for i, namespace in enumerate(watched)])


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
    assert [r["metadata"]["name"] for r in operator_roles(objects, "ClusterRole")] == [FINALIZERS]
    assert [b["roleRef"]["name"] for b in of_kind(objects, "ClusterRoleBinding")] == [FINALIZERS]
    granted = rendered_grants(objects)
    assert {g.namespace for g in granted} == {*recordings["namespaced"].namespaces, None}
    assert {g for g in granted if g.namespace is None} == {FINALIZER_GRANT}
    # The Roles alone allow every request: nothing leans on the cluster-wide patch.
    check(recordings["namespaced"], {g for g in granted if g.namespace is not None})
    check(recordings["namespaced"], granted)
    # ...and the cluster-wide traffic (all-namespace lists and watches) would be refused.
    with pytest.raises(AssertionError, match="refuses"):
        check(recordings["cluster"], granted)


def test_the_rules_are_the_operators_own(cluster_objects: list[dict[str, Any]]) -> None:
    """The chart grants exactly ``kvpool-operator rbac`` (kvpool.operator.rbac.RULES)."""
    (role,) = operator_roles(cluster_objects, "ClusterRole")
    assert grants(role["rules"], None) == grants((r.as_dict() for r in RULES), None)


def test_the_finalizer_rules_are_the_operators_own(helm: Helm) -> None:
    """Namespaced, the chart binds ``FINALIZER_RULES`` cluster-wide; cluster-wide, the
    operator's ClusterRole holds that right already, and no second role is rendered."""
    roles = {r["metadata"]["name"]: r for r in operator_roles(helm.template(), "ClusterRole")}
    assert roles[FINALIZERS]["rules"] == [r.as_dict() for r in FINALIZER_RULES]
    cluster_wide = helm.template(sets=["clusterWide=true"])
    assert FINALIZERS not in {r["metadata"]["name"] for r in of_kind(cluster_wide, "ClusterRole")}
    assert FINALIZER_GRANT in rendered_grants(cluster_wide)


@pytest.mark.parametrize("path", [RBAC_RULES_PATH, FINALIZER_RULES_PATH])
def test_a_missing_rules_file_fails_the_render(helm: Helm, chart_copy: Path, path: str) -> None:
    (chart_copy / (ROOT / path).relative_to(CHART)).unlink()
    with pytest.raises(AssertionError, match="is missing or empty"):
        helm.template(chart=chart_copy)


def test_no_wildcards_and_no_secrets(helm: Helm) -> None:
    for sets in ([], ["clusterWide=true"], ["watchNamespaces={a,b}"]):
        objects = helm.template(sets=sets)
        for role in of_kind(objects, "ClusterRole") + of_kind(objects, "Role"):
            for rule in role["rules"]:
                for key in ("apiGroups", "resources", "verbs"):
                    assert "*" not in rule[key], (role["metadata"]["name"], rule)
                assert "secrets" not in rule["resources"]
                assert "resourceNames" not in rule and "nonResourceURLs" not in rule


def test_namespaced_mode_binds_a_role_in_each_watched_namespace(helm: Helm) -> None:
    objects = helm.template(sets=["watchNamespaces={team-a,team-b,team-a}"])
    assert sorted(r["metadata"]["namespace"] for r in of_kind(objects, "Role")) == ["team-a", "team-b"]
    assert sorted(r["metadata"]["namespace"] for r in of_kind(objects, "RoleBinding")) == ["team-a", "team-b"]
    default = helm.template()
    assert [r["metadata"]["namespace"] for r in of_kind(default, "Role")] == [NAMESPACE]


def test_rbac_and_account_can_be_left_out(helm: Helm) -> None:
    objects = helm.template(
        sets=["rbac.create=false", "serviceAccount.create=false", "serviceAccount.name=ops"]
    )
    kinds = {o["kind"] for o in objects}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ServiceAccount"}
    aggregated = helm.template(sets=["rbac.aggregateToDefaultRoles=false"])
    assert [r["metadata"]["name"] for r in of_kind(aggregated, "ClusterRole")] == [FINALIZERS]
    bare = helm.template(sets=["rbac.aggregateToDefaultRoles=false", "rbac.finalizerClusterRole=false"])
    assert of_kind(bare, "ClusterRole") == of_kind(bare, "ClusterRoleBinding") == []
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops"


DEFAULT_ACCOUNT_REFUSALS = [
    pytest.param(
        ["serviceAccount.create=false"],
        "serviceAccount.create=false needs serviceAccount.name",
        id="not-created-no-name",
    ),
    pytest.param(
        ["serviceAccount.create=false", "clusterWide=true"],
        "serviceAccount.create=false needs serviceAccount.name",
        id="not-created-no-name-cluster-wide",
    ),
    pytest.param(
        ["serviceAccount.create=false", "serviceAccount.name=default"],
        "serviceAccount.name must not be default while rbac.create is true",
        id="not-created-named-default",
    ),
    pytest.param(
        ["serviceAccount.name=default"],
        "serviceAccount.name must not be default while rbac.create is true",
        id="created-named-default",
    ),
]


@pytest.mark.parametrize(("sets", "message"), DEFAULT_ACCOUNT_REFUSALS)
def test_the_operators_rights_are_never_bound_to_the_default_account(
    helm: Helm, sets: list[str], message: str
) -> None:
    """Every Pod of a namespace that names no ServiceAccount runs as its ``default`` one:
    bound to it, the operator's rights (create, patch and delete Deployments; everywhere with
    clusterWide) would be every such Pod's. The render fails, naming the value to set."""
    with pytest.raises(AssertionError, match=re.escape(message)) as refused:
        helm.template(sets=sets)
    assert "default ServiceAccount" in str(refused.value)


@pytest.mark.parametrize(
    "sets",
    [
        pytest.param([], id="namespaced"),
        pytest.param(["clusterWide=true"], id="cluster-wide"),
        pytest.param(["webhook.enabled=true"], id="leader-election"),
    ],
)
def test_an_account_of_your_own_is_the_one_bound(helm: Helm, sets: list[str]) -> None:
    objects = helm.template(sets=[*sets, "serviceAccount.create=false", "serviceAccount.name=kvpool-ops"])
    assert of_kind(objects, "ServiceAccount") == []
    bindings = of_kind(objects, "RoleBinding") + of_kind(objects, "ClusterRoleBinding")
    assert bindings
    for binding in bindings:
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "kvpool-ops", "namespace": NAMESPACE}
        ]
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "kvpool-ops"
    # Without rbac.create the chart binds nothing: the account, default or not, is yours to grant.
    unbound = helm.template(sets=[*sets, "serviceAccount.create=false", "rbac.create=false"])
    assert of_kind(unbound, "RoleBinding") == of_kind(unbound, "ClusterRoleBinding") == []
    assert one(unbound, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "default"


def test_the_proof_bites(cluster_objects: list[dict[str, Any]], recordings: dict[str, Recording]) -> None:
    granted = rendered_grants(cluster_objects)
    fewer = {g for g in granted if (g.resource, g.verb) != ("deployments", "patch")}
    with pytest.raises(AssertionError, match="refuses"):
        check(recordings["cluster"], fewer)
    with pytest.raises(AssertionError, match="never used"):
        check(recordings["cluster"], granted | {Grant("", "secrets", "get", None)})


def test_the_least_privileged_install_is_the_default(helm: Helm) -> None:
    """Namespaced unless asked: a Role and RoleBinding in the release namespace, the operator
    told so, and no cluster-wide right but patch on pools (to remove a pool's finalizer once its
    namespace's Role is gone); nothing else of kube-system's or any namespace's is reachable."""
    objects = helm.template()
    assert [r["metadata"]["name"] for r in operator_roles(objects, "ClusterRole")] == [FINALIZERS]
    granted = rendered_grants(objects)
    assert granted and {g.namespace for g in granted} == {NAMESPACE, None}
    assert {g for g in granted if g.namespace is None} == {FINALIZER_GRANT}
    args = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--namespace={NAMESPACE}" in args


def test_tenants_get_pools_through_the_aggregated_edit_and_view_roles(helm: Helm) -> None:
    from kvpool.operator.rbac import TENANT_EDIT_RULES, TENANT_VIEW_RULES

    for sets in ([], ["clusterWide=true"]):
        objects = helm.template(sets=sets)
        roles = {r["metadata"]["name"]: r for r in of_kind(objects, "ClusterRole")}
        edit, view = roles["kvpool-mooncake-kvpool-edit"], roles["kvpool-mooncake-kvpool-view"]
        assert {k: v for k, v in edit["metadata"]["labels"].items() if k.startswith(AGGREGATE)} == {
            f"{AGGREGATE}edit": "true",
            f"{AGGREGATE}admin": "true",
        }
        assert {k: v for k, v in view["metadata"]["labels"].items() if k.startswith(AGGREGATE)} == {
            f"{AGGREGATE}view": "true"
        }
        assert edit["rules"] == [r.as_dict() for r in TENANT_EDIT_RULES]
        assert view["rules"] == [r.as_dict() for r in TENANT_VIEW_RULES]
        # Only on pools, bound to nobody: they grant through edit/admin/view bindings alone.
        for role in (edit, view):
            assert {g for rule in role["rules"] for g in rule["apiGroups"]} == {"kvpool.mooncake.io"}
        bound = {
            b["roleRef"]["name"]
            for b in of_kind(objects, "ClusterRoleBinding") + of_kind(objects, "RoleBinding")
        }
        assert not bound & set(roles) - {"kvpool-mooncake-kvpool", FINALIZERS}
    assert {v for rule in view["rules"] for v in rule["verbs"]} == {"get", "list", "watch"}
