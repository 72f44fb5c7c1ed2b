"""What a rendered chart grants its operator's ServiceAccount, and what a request needs:
shared by the chart's RBAC proof (``test_chart_rbac``) and the end-to-end suite, which runs the
operator as the chart installs it and checks its every request against the rendered roles."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvpool.operator.rbac import Permission, request_permission
from tests.chart.helm import of_kind, one


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
    return set().union(*grants_by_binding(objects).values())


def grants_by_binding(objects: list[dict[str, Any]]) -> dict[tuple[str, str | None, str], set[Grant]]:
    """What each of the chart's bindings gives its ServiceAccount, by (kind, namespace, name) of
    the binding: what is left when one of them is deleted (as a namespace's deletion does)."""
    account = one(objects, "ServiceAccount")["metadata"]
    subject = {"kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]}
    roles = {("ClusterRole", r["metadata"]["name"], None): r for r in of_kind(objects, "ClusterRole")}
    roles |= {
        ("Role", r["metadata"]["name"], r["metadata"]["namespace"]): r for r in of_kind(objects, "Role")
    }
    out: dict[tuple[str, str | None, str], set[Grant]] = {}
    for binding in of_kind(objects, "ClusterRoleBinding") + of_kind(objects, "RoleBinding"):
        assert binding["subjects"] == [subject], binding["metadata"]["name"]
        ref = binding["roleRef"]
        assert ref["apiGroup"] == "rbac.authorization.k8s.io"
        where = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
        role = roles[(ref["kind"], ref["name"], where if ref["kind"] == "Role" else None)]
        out[(binding["kind"], where, binding["metadata"]["name"])] = grants(role["rules"], where)
    return out


def needed_by(method: str, url: str) -> tuple[Permission | None, str | None]:
    """The permission a request needs, and in which namespace (None: cluster-wide)."""
    permission = request_permission(method, url)
    # ".../namespaces/<ns>/<plural>..." is namespaced; a plain list or watch is cluster-wide.
    segments = [s for s in urlsplit(url).path.split("/") if s]
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


def refused(requests: Iterable[tuple[str, str, list[Permission]]], granted: set[Grant]) -> list[str]:
    """Each (method, URL, permissions its body implies) that ``granted`` does not allow."""
    out = []
    for method, url, implied in requests:
        permission, namespace = needed_by(method, url)
        wanted = ([permission] if permission is not None else []) + list(implied)
        if any(not any(allows(g, p, namespace) for g in granted) for p in wanted):
            out.append(f"{method} {urlsplit(url).path}")
    return out
