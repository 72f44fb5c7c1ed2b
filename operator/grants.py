"""Grants: a pool's memory shared out to tenants, as Mooncake's multi-tenancy enforces it (pure).

A ``MooncakeKVPoolGrant`` names a pool and a ceiling. Each grant is one Mooncake tenant and
one reuse domain; grants that declare the same ``reuseDomain`` are one tenant, whose quota
is the largest of their ceilings. The master reads every tenant's quota from the policy
the pool renders (``connector.contract.tenant_policy``) and, when the quotas add up to more
than its memory, cuts each in proportion: the grants' status says so. A consumer names a
grant in its own namespace; the tenant is rendered into its connector settings.
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

# Conditions of a grant.
ACCEPTED = "Accepted"  # the pool serves it: it names a pool with tenancy on, and is valid
CUT = "Cut"  # its ceiling is cut: the pool's grants ask more than its memory
_TENANT_MAX = 63


@dataclass(frozen=True)
class Grant:
    """One grant as read from the API: its spec, or why it has none."""

    name: str
    namespace: str
    generation: int | None
    spec: GrantSpec | None
    problem: str = ""


def read_grant(obj: Mapping[str, Any]) -> Grant:
    """A grant object's spec; a spec the models refuse is named by field and rule."""
    meta = obj.get("metadata") or {}
    try:
        spec: GrantSpec | None = GrantSpec.model_validate(obj.get("spec") or {})
        problem = ""
    except ValidationError as exc:
        first = exc.errors()[0]
        spec, problem = None, f"spec.{field_path(first['loc'])}: {error_message(first)}"
    return Grant(str(meta.get("name")), str(meta.get("namespace")), meta.get("generation"), spec, problem)


def tenant_of(grant: Grant) -> str:
    """The Mooncake tenant of a grant: ``domain.<reuseDomain>``, or ``<namespace>.<name>``
    (a digest of it when longer than a tenant may be)."""
    assert grant.spec is not None
    if grant.spec.reuse_domain:
        return f"domain.{grant.spec.reuse_domain}"
    own = f"{grant.namespace}.{grant.name}"
    if len(own) <= _TENANT_MAX:
        return own
    digest = hashlib.sha256(own.encode()).hexdigest()[:16]
    return f"{grant.namespace[:40].rstrip('-.')}.{digest}"


@dataclass(frozen=True)
class Tenancy:
    """The tenants of one pool's grants, their quotas and what the master admits."""

    requested: dict[str, int] = field(default_factory=dict)  # tenant -> quota in the policy
    effective: dict[str, int] = field(default_factory=dict)  # tenant -> after the cut
    tenants: dict[str, str] = field(default_factory=dict)  # grant name -> tenant
    capacity: int | None = None  # the memory the pool declares (None: not known ahead)

    def policy(self) -> str:
        return policy_yaml(self.requested)

    def cut(self, tenant: str) -> bool:
        return self.effective.get(tenant, 0) < self.requested.get(tenant, 0)


def plan_tenancy(pool: str, grants: Sequence[Grant], capacity: int | None) -> Tenancy:
    """The tenants of the grants that name ``pool`` (valid ones only), cut as Mooncake cuts."""
    requested: dict[str, int] = {}
    tenants: dict[str, str] = {}
    for grant in sorted(grants, key=lambda g: g.name):
        if grant.spec is None or grant.spec.pool != pool:
            continue
        tenant = tenant_of(grant)
        tenants[grant.name] = tenant
        requested[tenant] = max(requested.get(tenant, 0), grant.spec.ceiling)
    effective = dict(requested) if capacity is None else effective_quotas(requested, capacity)
    return Tenancy(requested, effective, tenants, capacity)


def _condition(kind: str, status: str, reason: str, message: str, generation: int | None) -> dict[str, Any]:
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def grant_status(grant: Grant, tenancy: Tenancy | None, refusal: str = "") -> dict[str, Any]:
    """The status a grant should have (without transition times): ``tenancy`` None with a
    ``refusal`` when its pool does not serve grants."""
    gen = grant.generation
    if grant.spec is None:
        return {
            "observedGeneration": gen,
            "conditions": [_condition(ACCEPTED, "False", "Invalid", grant.problem, gen)],
        }
    if tenancy is None or grant.name not in tenancy.tenants:
        return {
            "observedGeneration": gen,
            "conditions": [_condition(ACCEPTED, "False", "PoolRefuses", refusal, gen)],
        }
    tenant = tenancy.tenants[grant.name]
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
        "ceiling": format_bytes(effective),
        "ceilingBytes": effective,
        "conditions": [
            _condition(ACCEPTED, "True", "Accepted", accepted, gen),
            cut,
        ],
    }


def consumer_grant_problems(pool: str, spec: PoolSpec, grants: Sequence[Grant]) -> list[Problem]:
    """Each consumer of a pool with tenancy that names no grant, or one that is not in its
    namespace, not valid or of another pool (the grant's own name is in the message)."""
    if not spec.tenancy.enabled:
        return []
    by_name = {g.name: g for g in grants}
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
        elif grant.spec.pool != pool:
            rule, message = "grant-other-pool", f"grant {grant.name!r} is a share of pool {grant.spec.pool!r}"
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
