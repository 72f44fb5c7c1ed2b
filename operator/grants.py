"""Grants: a pool's memory shared out to tenants, as Mooncake's multi-tenancy enforces it (pure).

A ``MooncakeKVPoolGrant`` names a pool and a ceiling. Each grant is one Mooncake tenant and
one reuse domain; grants that declare the same ``reuseDomain`` are one tenant, whose quota
is the largest of their ceilings. The master reads every tenant's quota from the policy
the pool renders (``connector.contract.tenant_policy``) and, when the quotas add up to more
than its memory, cuts each in proportion: the grants' status says so. A consumer names a
grant in its own namespace; the tenant is rendered into its connector settings.

A grant may also live in another namespace than its pool's (``spec.poolNamespace``): the
pool honours it only when its admin listed that namespace (``spec.tenancy.grantNamespaces``).
Such a grant's consumers are the tenant's own to configure (the grant's status carries the
master's address and the tenant); a reuse domain stays within one namespace.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from kvpool.connector.contract.errors import error_message, field_path
from kvpool.connector.contract.layout import Problem
from kvpool.connector.contract.tenant_policy import POLICY_FILE, effective_quotas, policy_yaml
from kvpool.operator import names
from kvpool.operator.spec import GrantSpec, PoolSpec, format_bytes
from kvpool.operator.validation import check_consumer_list

# Conditions of a grant.
ACCEPTED = "Accepted"  # the pool serves it: it names a pool with tenancy on, and is valid
CUT = "Cut"  # its ceiling is cut: the pool's grants ask more than its memory
# Reasons a grant is not accepted (besides Invalid).
POOL_REFUSES = "PoolRefuses"  # its pool does not serve grants (invalid, tenancy off)
NAMESPACE_NOT_ALLOWED = "NamespaceNotAllowed"  # its pool does not list the grant's namespace
POOL_NOT_FOUND = "PoolNotFound"  # its pool does not exist (yet, or any more)
TENANT_TAKEN = "TenantTaken"  # its tenant is another namespace's grant's
_TENANT_MAX = 63
_DIGEST_CHARS = 16


@dataclass(frozen=True)
class Grant:
    """One grant as read from the API: its spec, or why it has none."""

    name: str
    namespace: str
    generation: int | None
    spec: GrantSpec | None
    problem: str = ""
    uid: str = ""


def read_grant(obj: Mapping[str, Any]) -> Grant:
    """A grant object's spec; a spec the models or the consumer rules refuse is named by
    field and rule."""
    meta = obj.get("metadata") or {}
    namespace = str(meta.get("namespace"))
    try:
        spec: GrantSpec | None = GrantSpec.model_validate(obj.get("spec") or {})
        problem = ""
    except ValidationError as exc:
        first = exc.errors()[0]
        spec, problem = None, f"spec.{field_path(first['loc'])}: {error_message(first)}"
    if spec is not None:
        problems = grant_consumer_problems(spec, namespace)
        if problems:
            spec, problem = None, "; ".join(str(p) for p in problems)
    return Grant(
        str(meta.get("name")), namespace, meta.get("generation"), spec, problem, str(meta.get("uid") or "")
    )


def grant_consumer_problems(spec: GrantSpec, namespace: str) -> list[Problem]:
    """A grant's consumers: only in another namespace than its pool's, each by the pool's rules."""
    if spec.consumers and (spec.pool_namespace or namespace) == namespace:
        return [
            Problem(
                field="spec.consumers",
                rule="own-namespace-consumers",
                message="a grant in its pool's namespace lists no consumers: the pool's spec.consumers does",
            )
        ]
    return check_consumer_list(spec.consumers)


def pool_namespace_of(grant: Grant) -> str:
    """The namespace of the pool a grant names: ``spec.poolNamespace``, else its own."""
    assert grant.spec is not None
    return grant.spec.pool_namespace or grant.namespace


def grant_ref(grant: Grant, pool_namespace: str) -> str:
    """How a pool names one of its grants: ``<name>`` in its own namespace, else ``<namespace>/<name>``."""
    return grant.name if grant.namespace == pool_namespace else f"{grant.namespace}/{grant.name}"


def tenant_of(grant: Grant, pool_namespace: str | None = None) -> str:
    """The Mooncake tenant of a grant: ``domain.<reuseDomain>`` in the pool's namespace,
    ``<namespace>.domain-<reuseDomain>`` in another one (a reuse domain never spans two
    namespaces: a tenant cannot join another namespace's blocks by naming its domain), else
    ``<namespace>.<name>``; a digest of it when longer than a tenant may be: after the whole
    namespace and a dot, or, where that is too long, after the namespace's first characters
    and a dash (a cut namespace and a dot would be the tenant of a grant of that namespace)."""
    assert grant.spec is not None
    domain = grant.spec.reuse_domain
    if domain and grant.namespace == (pool_namespace or grant.namespace):
        return f"domain.{domain}"
    own = f"{grant.namespace}.domain-{domain}" if domain else f"{grant.namespace}.{grant.name}"
    if len(own) <= _TENANT_MAX:
        return own
    digest = hashlib.sha256(own.encode()).hexdigest()[:_DIGEST_CHARS]
    if len(grant.namespace) + 1 + _DIGEST_CHARS <= _TENANT_MAX:
        return f"{grant.namespace}.{digest}"
    return f"{grant.namespace[: _TENANT_MAX - 1 - _DIGEST_CHARS]}-{digest}"


def namespace_refusal(
    grant_namespace: str, pool_namespace: str, pool: str, grant_namespaces: Sequence[str]
) -> str | None:
    """Why pool ``pool_namespace/pool`` does not take grants from ``grant_namespace`` (None: it does)."""
    if grant_namespace == pool_namespace or grant_namespace in grant_namespaces:
        return None
    return (
        f"pool {pool_namespace}/{pool} does not list namespace {grant_namespace} in "
        "spec.tenancy.grantNamespaces"
    )


@dataclass(frozen=True)
class Tenancy:
    """The tenants of one pool's grants, their quotas and what the master admits."""

    requested: dict[str, int] = field(default_factory=dict)  # tenant -> quota in the policy
    effective: dict[str, int] = field(default_factory=dict)  # tenant -> after the cut
    tenants: dict[str, str] = field(default_factory=dict)  # grant ref (``grant_ref``) -> tenant
    capacity: int | None = None  # the memory the pool declares (None: not known ahead)
    namespace: str = ""  # the pool's
    # Grant refs left out because their tenant is a grant's of another namespace -> why.
    taken: dict[str, str] = field(default_factory=dict)

    def policy(self) -> str:
        return policy_yaml(self.requested)

    def cut(self, tenant: str) -> bool:
        return self.effective.get(tenant, 0) < self.requested.get(tenant, 0)


def honoured(grant: Grant, pool: str, namespace: str, grant_namespaces: Sequence[str]) -> bool:
    """Whether pool ``namespace/pool`` serves ``grant``: valid, naming it, from an allowed namespace."""
    return (
        grant.spec is not None
        and grant.spec.pool == pool
        and pool_namespace_of(grant) == namespace
        and namespace_refusal(grant.namespace, namespace, pool, grant_namespaces) is None
    )


def plan_tenancy(
    pool: str,
    namespace: str,
    grants: Sequence[Grant],
    capacity: int | None,
    grant_namespaces: Sequence[str] = (),
) -> Tenancy:
    """The tenants of the grants ``pool`` honours (``honoured``), cut as Mooncake cuts. A tenant
    is one namespace's: a grant whose tenant a grant of another namespace holds (the pool's own
    first) is left out, since sharing the tenant would share that namespace's blocks."""
    requested: dict[str, int] = {}
    tenants: dict[str, str] = {}
    holders: dict[str, str] = {}  # tenant -> the namespace whose grants it is
    taken: dict[str, str] = {}
    for grant in sorted(grants, key=lambda g: (g.namespace != namespace, g.namespace, g.name)):
        if not honoured(grant, pool, namespace, grant_namespaces):
            continue
        assert grant.spec is not None
        tenant = tenant_of(grant, namespace)
        holder = holders.setdefault(tenant, grant.namespace)
        if holder != grant.namespace:
            taken[grant_ref(grant, namespace)] = (
                f"its tenant {tenant} is a tenant of namespace {holder}'s grants in pool "
                f"{namespace}/{pool}: rename the grant (a tenant never spans two namespaces)"
            )
            continue
        tenants[grant_ref(grant, namespace)] = tenant
        requested[tenant] = max(requested.get(tenant, 0), grant.spec.ceiling)
    effective = dict(requested) if capacity is None else effective_quotas(requested, capacity)
    return Tenancy(requested, effective, tenants, capacity, namespace, taken)


def _condition(kind: str, status: str, reason: str, message: str, generation: int | None) -> dict[str, Any]:
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def grant_status(
    grant: Grant,
    tenancy: Tenancy | None,
    refusal: str = "",
    master_address: str = "",
    reason: str = POOL_REFUSES,
    consumers: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The status a grant should have (without transition times): ``tenancy`` None with a
    ``refusal`` (and its ``reason``) when its pool does not serve it; ``consumers`` where its
    consumers stand (``grant_consumer_statuses``)."""
    gen = grant.generation
    if grant.spec is None:
        return {
            "observedGeneration": gen,
            "conditions": [_condition(ACCEPTED, "False", "Invalid", grant.problem, gen)],
        }
    ref = grant_ref(grant, tenancy.namespace) if tenancy is not None else ""
    if tenancy is not None and ref in tenancy.taken:
        refusal, reason = tenancy.taken[ref], TENANT_TAKEN
    if tenancy is None or ref not in tenancy.tenants:
        return {
            "observedGeneration": gen,
            "conditions": [_condition(ACCEPTED, "False", reason, refusal, gen)],
        }
    tenant = tenancy.tenants[ref]
    effective = tenancy.effective[tenant]
    requested = tenancy.requested[tenant]
    if tenancy.capacity is None:
        cut = _condition(
            CUT, "Unknown", "CapacityNotDeclared", "the master cuts against its mounted memory", gen
        )
    elif tenancy.cut(tenant):
        total = sum(tenancy.requested.values())
        cut = _condition(
            CUT,
            "True",
            "Oversubscribed",
            f"the pool's grants ask {format_bytes(total)} of its {format_bytes(tenancy.capacity)}: "
            f"{format_bytes(requested)} cut to {format_bytes(effective)} ({effective} bytes)",
            gen,
        )
    else:
        cut = _condition(
            CUT, "False", "Fits", f"the pool's grants fit in its {format_bytes(tenancy.capacity)}", gen
        )
    accepted = f"tenant {tenant} in the pool's quota policy (a master reads it when it starts)"
    return {
        "observedGeneration": gen,
        "tenant": tenant,
        **({"masterServerAddress": master_address} if master_address else {}),
        "ceiling": format_bytes(effective),
        "ceilingBytes": effective,
        **({"consumers": [dict(c) for c in consumers]} if consumers else {}),
        "conditions": [
            _condition(ACCEPTED, "True", "Accepted", accepted, gen),
            cut,
        ],
    }


def grant_consumer_statuses(
    grant: Grant, pool_consumers: Sequence[Mapping[str, Any]], listed_elsewhere: Mapping[str, str]
) -> list[dict[str, Any]]:
    """Where each consumer another namespace's grant lists stands, from the pool's status
    (``namespace/name`` entries), so the tenant sees it without reading the pool: one another
    grant of its namespace lists first is that grant's."""
    if grant.spec is None:
        return []
    found = {str(c.get("name")): c for c in pool_consumers}
    out = []
    for consumer in grant.spec.consumers:
        if consumer.name in listed_elsewhere:
            first = listed_elsewhere[consumer.name]
            message = f"not rolled: grant {first} lists this Deployment too and takes it (first by name)"
            out.append({"name": consumer.name, "rolledOut": False, "message": message})
            continue
        entry = found.get(f"{grant.namespace}/{consumer.name}") or {}
        message = str(entry.get("message") or "not rolled yet")
        out.append({"name": consumer.name, "rolledOut": bool(entry.get("rolledOut")), "message": message})
    return out


def consumer_grant_problems(
    pool: str, namespace: str, spec: PoolSpec, grants: Sequence[Grant]
) -> list[Problem]:
    """Each consumer of a pool with tenancy that names no grant, or one that is not in its
    namespace, not valid or of another pool (the grant's own name is in the message)."""
    if not spec.tenancy.enabled:
        return []
    by_name = {g.name: g for g in grants if g.namespace == namespace}
    problems = []
    for index, consumer in enumerate(spec.consumers):
        grant = by_name.get(consumer.grant or "")
        if consumer.grant is None:
            rule, message = "consumer-grant", "with spec.tenancy.enabled every consumer names a grant"
        elif grant is None:
            rule = "grant-not-found"
            message = f"no MooncakeKVPoolGrant {consumer.grant!r} in the consumer's namespace"
        elif grant.spec is None:
            rule, message = "grant-invalid", f"grant {grant.name!r} is invalid: {grant.problem}"
        elif grant.spec.pool != pool or pool_namespace_of(grant) != namespace:
            other = f"{pool_namespace_of(grant)}/{grant.spec.pool}"
            rule, message = "grant-other-pool", f"grant {grant.name!r} is a share of pool {other}"
        else:
            continue
        problems.append(Problem(field=f"spec.consumers[{index}].grant", rule=rule, message=message))
    return problems


def tenants_configmap(pool: str, namespace: str, tenancy: Tenancy) -> dict[str, Any]:
    """ConfigMap ``<pool>-tenants``: the master's quota policy (mounted into the master)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": names.child_metadata(pool, namespace, names.tenants_configmap_name(pool), names.MASTER),
        "data": {POLICY_FILE: tenancy.policy()},
    }
