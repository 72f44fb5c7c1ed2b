"""The API verbs and resources the operator uses: the source for the chart's RBAC rules.

``RULES`` lists exactly what the operator calls (its own requests and kopf's).
``WEBHOOK_RULES`` are needed only when kopf manages the webhook configuration.
``request_permission`` maps a recorded HTTP request to the permission it needs, so
tests can prove every recorded request is covered and no rule goes unused.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from kvpool.operator.resources import (
    CONFIGMAPS,
    DEPLOYMENTS,
    EVENTS,
    NETWORK_POLICIES,
    POOLS,
    SERVICES,
)


@dataclass(frozen=True)
class Rule:
    """One RBAC rule: API group, resources, verbs."""

    api_group: str
    resources: tuple[str, ...]
    verbs: tuple[str, ...]

    def as_dict(self) -> dict[str, list[str]]:
        return {"apiGroups": [self.api_group], "resources": list(self.resources), "verbs": list(self.verbs)}


@dataclass(frozen=True)
class Permission:
    """What one request needs: group, resource (``plural[/subresource]``), verb."""

    api_group: str
    resource: str
    verb: str


RULES: tuple[Rule, ...] = (
    # kopf lists/watches pools and patches its annotations and finalizer; the operator
    # reads each pool fresh and writes its status.
    Rule(POOLS.group, (POOLS.plural,), ("get", "list", "watch", "patch")),
    Rule(POOLS.group, (f"{POOLS.plural}/status",), ("patch",)),
    # Children (master, store) and consumers (list: release the ones no longer declared).
    Rule(DEPLOYMENTS.group, (DEPLOYMENTS.plural,), ("get", "list", "create", "patch", "delete")),
    Rule(SERVICES.group, (SERVICES.plural, CONFIGMAPS.plural), ("get", "create", "patch", "delete")),
    Rule(NETWORK_POLICIES.group, (NETWORK_POLICIES.plural,), ("get", "create", "patch", "delete")),
    # Events posted by kopf about pools.
    Rule(EVENTS.group, (EVENTS.plural,), ("create",)),
)

WEBHOOK_RULES: tuple[Rule, ...] = (
    Rule("admissionregistration.k8s.io", ("validatingwebhookconfigurations",), ("create", "patch")),
)


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
    return Permission(group, resource, verb)


def allowed(permission: Permission, rules: tuple[Rule, ...] = RULES) -> Rule | None:
    """The rule that grants ``permission``, if any."""
    for rule in rules:
        if (
            rule.api_group == permission.api_group
            and permission.resource in rule.resources
            and permission.verb in rule.verbs
        ):
            return rule
    return None
