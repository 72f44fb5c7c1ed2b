"""The API verbs and resources the operator uses: the one source of the chart's RBAC rules.

``RULES`` lists exactly what the operator calls (its own requests and kopf's), and what
the API server's admission checks for them; ``render_rules`` writes them as the chart
ships them. ``TENANT_RULES`` are what the chart aggregates into Kubernetes' ``edit`` and
``view`` ClusterRoles for the people who write pools. ``WEBHOOK_RULES`` are needed only
when kopf manages the webhook configuration. ``FINALIZER_RULES`` are what the chart binds
cluster-wide in namespaced mode, to let pools go whose namespace's Role is gone.
``request_permission`` maps a recorded HTTP request to the permission it needs and
``implied_permissions`` what its body needs besides, so tests can prove every recorded request
is covered and no rule goes unused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

from kvpool.operator.names import (
    CONFIGMAPS,
    DEPLOYMENTS,
    EVENTS,
    GRANTS,
    LEASE_NAME,
    LEASES,
    NETWORK_POLICIES,
    POD_DISRUPTION_BUDGETS,
    PODS,
    POOLS,
    SERVICES,
    api_resource_of,
)


@dataclass(frozen=True)
class Rule:
    """One RBAC rule: API group, resources, verbs (and, when set, the only objects it names)."""

    api_group: str
    resources: tuple[str, ...]
    verbs: tuple[str, ...]
    resource_names: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, list[str]]:
        out = {"apiGroups": [self.api_group], "resources": list(self.resources), "verbs": list(self.verbs)}
        if self.resource_names:
            out["resourceNames"] = list(self.resource_names)
        return out


@dataclass(frozen=True)
class Permission:
    """What one request needs: group, resource (``plural[/subresource]``), verb."""

    api_group: str
    resource: str
    verb: str
    name: str | None = field(default=None, compare=False)  # the object a request names, if one


RULES: tuple[Rule, ...] = (
    # kopf lists/watches pools and patches its annotations and finalizer; the operator
    # reads each pool fresh and writes its status.
    Rule(POOLS.group, (POOLS.plural,), ("get", "list", "watch", "patch")),
    Rule(POOLS.group, (f"{POOLS.plural}/status",), ("patch",)),
    # Grants: read (the tenants of a pool with tenancy, watched for a pass) and their status.
    Rule(GRANTS.group, (GRANTS.plural,), ("get", "list", "watch")),
    Rule(GRANTS.group, (f"{GRANTS.plural}/status",), ("patch",)),
    # Children carry an ownerReference with blockOwnerDeletion: the API server's
    # OwnerReferencesPermissionEnforcement admission wants update on the pool's finalizers.
    Rule(POOLS.group, (f"{POOLS.plural}/finalizers",), ("update",)),
    # Children (master, store) and consumers (list: release the ones no longer declared;
    # watch: a pass as soon as one of them changes).
    Rule(DEPLOYMENTS.group, (DEPLOYMENTS.plural,), ("get", "list", "watch", "create", "patch", "delete")),
    Rule(SERVICES.group, (SERVICES.plural, CONFIGMAPS.plural), ("get", "create", "patch", "delete")),
    # The pool's own policies; list: the namespace's policies that select its consumers.
    Rule(NETWORK_POLICIES.group, (NETWORK_POLICIES.plural,), ("get", "list", "create", "patch", "delete")),
    Rule(
        POD_DISRUPTION_BUDGETS.group, (POD_DISRUPTION_BUDGETS.plural,), ("get", "create", "patch", "delete")
    ),
    # Pods, read only: an HA pool's master pods (their IPs are the only addresses a leader
    # check may ask), store pods (to name segments) and consumer pods (asked for their hits).
    Rule(PODS.group, (PODS.plural,), ("list",)),
    # Events posted by kopf about pools.
    Rule(EVENTS.group, (EVENTS.plural,), ("create",)),
)

# Bound cluster-wide in namespaced mode, for one thing: removing a pool's finalizer (kopf's
# patch of ``metadata.finalizers``) once the Role in its namespace is gone, as it goes first
# when the namespace is deleted. RBAC cannot narrow a verb to a field or to namespaces being
# deleted, so this is ``patch`` on pools, the least that does it: no read, list or watch, no
# status, nothing else. The operator's other requests never depend on it (the chart's tests
# check its traffic against the Roles alone), and it never writes a pool's spec.
FINALIZER_RULES: tuple[Rule, ...] = (Rule(POOLS.group, (POOLS.plural,), ("patch",)),)

# What tenants may do with pools: aggregated into Kubernetes' own ``edit`` (and ``admin``) and
# ``view`` ClusterRoles, so whoever may edit or view a namespace may do the same with its pools.
TENANT_EDIT_RULES: tuple[Rule, ...] = (
    Rule(
        POOLS.group,
        (POOLS.plural,),
        ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"),
    ),
    Rule(POOLS.group, (f"{POOLS.plural}/status",), ("get", "list", "watch")),
    # Grants are the cluster admin's: a namespace's editors see theirs, never make one.
    Rule(GRANTS.group, (GRANTS.plural, f"{GRANTS.plural}/status"), ("get", "list", "watch")),
)
TENANT_VIEW_RULES: tuple[Rule, ...] = (
    Rule(POOLS.group, (POOLS.plural, f"{POOLS.plural}/status"), ("get", "list", "watch")),
    Rule(GRANTS.group, (GRANTS.plural, f"{GRANTS.plural}/status"), ("get", "list", "watch")),
)
# Grants made by namespace admins, when the cluster admin allows it (the chart's
# ``rbac.namespaceAdminsGrant``): aggregated into ``admin`` only. A namespace admin then
# decides its namespace's share of a pool, within what the pool's memory holds (cut otherwise).
TENANT_GRANT_RULES: tuple[Rule, ...] = (
    Rule(GRANTS.group, (GRANTS.plural,), ("create", "update", "patch", "delete", "deletecollection")),
)
TENANT_RULES = {"edit": TENANT_EDIT_RULES, "view": TENANT_VIEW_RULES, "grant": TENANT_GRANT_RULES}


def lease_rules(name: str = LEASE_NAME) -> tuple[Rule, ...]:
    """Leader election: the operator's own Lease ``name`` in its own namespace (a Role
    there), by name where RBAC can say it (a create names no object)."""
    return (
        Rule(LEASES.group, (LEASES.plural,), ("create",)),
        Rule(LEASES.group, (LEASES.plural,), ("get", "patch"), (name,)),
    )


LEASE_RULES = lease_rules()

WEBHOOK_RULES: tuple[Rule, ...] = (
    Rule(
        "admissionregistration.k8s.io",
        ("validatingwebhookconfigurations", "mutatingwebhookconfigurations"),
        ("create", "patch"),
    ),
)


def render_rules(rules: tuple[Rule, ...] = RULES, command: str = "kvpool-operator rbac") -> str:
    """The rules as YAML, exactly as the chart ships them (``command`` prints it)."""
    header = f"# Generated by `{command}`; do not edit by hand.\n"
    return header + yaml.safe_dump([rule.as_dict() for rule in rules], sort_keys=False)


def request_permission(method: str, url: str) -> Permission | None:
    """The permission an API request needs; None for discovery (non-resource) URLs."""
    parts = urlsplit(url)
    segments = [s for s in parts.path.split("/") if s]
    if segments[:1] == ["api"] and len(segments) >= 2:
        group, rest = "", segments[2:]
    elif segments[:1] == ["apis"] and len(segments) >= 3:
        group, rest = segments[1], segments[3:]
    else:
        return None
    if rest[:1] == ["namespaces"] and len(rest) >= 3:
        rest = rest[2:]
    elif rest[:1] == ["namespaces"]:
        return Permission("", "namespaces", "get" if len(rest) == 2 else "list")
    if not rest:
        return None
    plural, name, sub = rest[0], rest[1] if len(rest) > 1 else None, rest[2:]
    resource = "/".join([plural, *sub])
    watching = parse_qs(parts.query).get("watch", ["false"])[0] in ("true", "1")
    verb = {
        "GET": "watch" if watching else ("get" if name else "list"),
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete" if name else "deletecollection",
    }.get(method.upper(), method.lower())
    return Permission(group, resource, verb, name)


def implied_permissions(method: str, body: Any) -> list[Permission]:
    """What a write's body needs beyond its verb: setting ``blockOwnerDeletion`` on an owner
    reference needs ``update`` on the owner's ``finalizers`` (OwnerReferencesPermissionEnforcement)."""
    if method.upper() not in ("POST", "PUT", "PATCH") or not isinstance(body, Mapping):
        return []
    out = []
    for ref in (body.get("metadata") or {}).get("ownerReferences") or []:
        if not ref.get("blockOwnerDeletion"):
            continue
        try:
            owner = api_resource_of({"apiVersion": ref.get("apiVersion"), "kind": ref.get("kind")})
        except KeyError:
            continue
        out.append(Permission(owner.group, f"{owner.plural}/finalizers", "update"))
    return out


def allowed(permission: Permission, rules: tuple[Rule, ...] = RULES) -> Rule | None:
    """The rule that grants ``permission``, if any."""
    for rule in rules:
        if (
            rule.api_group == permission.api_group
            and permission.resource in rule.resources
            and permission.verb in rule.verbs
            and (not rule.resource_names or permission.name in rule.resource_names)
        ):
            return rule
    return None
