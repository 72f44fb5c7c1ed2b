"""Usage per grant: each grant's tenant as the pool's master counts it (pure).

The observation timer reads the master's ``/metrics`` once a poll (``observation``); with
``--enable_multi_tenants`` that text carries each tenant's quota and charge
(``master_view.TenantNumbers``). From the same poll:

* ``grant_usage``: the grant's ``status.usage``: what the master charges its tenant, the quota
  it enforces, the writes it refused; or, when that is not known, ``state: Unknown`` and why
  (not asked, no answer, a master that does not know the tenant): never a zero that was not
  observed;
* ``capacity.pool_grants``: the same per grant in the pool's ``status.capacity.grants``.

Grants of one reuse domain are one tenant: each shows the tenant's numbers, and names the
others (``sharedWith``). Only tenants of the pool's own grants are read from the text: a
tenant the master reports that no grant names stays out of every status.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpool.operator.capacity import NO_ENDPOINTS, NOT_ADMITTED, UNKNOWN, percent, quantity, used_text
from kvpool.operator.master_view import TenantNumbers
from kvpool.operator.observation import Observation

MAX_SHARED = 64


def _unknown(reason: str, message: str) -> dict[str, Any]:
    return {"state": "Unknown", "reason": reason, "message": message[:1024], "used": UNKNOWN}


def tenant_numbers(
    tenant: str, observation: Observation | None, asked: bool, external: bool
) -> TenantNumbers | dict[str, Any]:
    """The tenant's numbers from the poll, or the usage that says why they are not known."""
    if not asked:
        return _unknown("NotAsked", NO_ENDPOINTS if external else NOT_ADMITTED)
    if observation is None:
        return _unknown("NotYet", "the master has not been asked yet")
    numbers = observation.numbers
    if numbers is None:
        return _unknown(observation.reason, observation.problem or "no answer")
    if not numbers.tenants:
        return _unknown(
            "NoTenancyAtMaster",
            f"the master at {observation.master} reports no tenant: it runs without "
            "--enable_multi_tenants, or with a policy that names none",
        )
    found = numbers.tenants.get(tenant)
    if found is None:
        return _unknown(
            "TenantNotAtMaster",
            f"the master at {observation.master} does not know tenant {tenant}: it reads the "
            "quota policy when it starts (a grant added since reaches it at its next start); "
            "until then the grant's consumers are refused (tenant not registered) and recompute",
        )
    return found


def grant_usage(
    grant: str,
    tenants: Mapping[str, str],
    observation: Observation | None,
    *,
    asked: bool,
    external: bool = False,
) -> dict[str, Any]:
    """The ``status.usage`` of ``grant`` (one of ``tenants``: grant name -> tenant), without
    ``changedAt`` (``with_changed_at`` keeps it while the usage holds still)."""
    tenant = tenants[grant]
    shared = sorted(g for g, t in tenants.items() if t == tenant and g != grant)[:MAX_SHARED]
    found = tenant_numbers(tenant, observation, asked, external)
    usage: dict[str, Any]
    if isinstance(found, TenantNumbers):
        assert observation is not None
        usage = {
            "state": "Observed",
            "reason": "Answered",
            "message": f"tenant {tenant} as the master at {observation.master} counts it",
            "used": used_text(found),
            "usedBytes": found.charged_bytes,
            "usedPercent": percent(found.charged_bytes, found.effective_bytes),
            "quota": quantity(found.effective_bytes),
            "quotaBytes": found.effective_bytes,
            "requestedBytes": found.requested_bytes,
            "overQuota": found.over_quota,
            "admissionClosed": found.admission_closed,
            "rejectedWrites": found.rejected_writes,
            "evictedBytes": found.evicted_bytes,
        }
    else:
        usage = found
    if shared:
        usage["sharedWith"] = shared
    return usage


def with_changed_at(usage: dict[str, Any], old: Mapping[str, Any] | None, now: str) -> dict[str, Any]:
    """``usage`` with ``changedAt``: the old one's when nothing else changed, else ``now``."""
    if isinstance(old, Mapping) and {**old, "changedAt": None} == {**usage, "changedAt": None}:
        return {**usage, "changedAt": old.get("changedAt")}
    return {**usage, "changedAt": now}
