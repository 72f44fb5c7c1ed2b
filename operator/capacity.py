"""The pool's capacity and health in its status, from what its master said (pure).

``status.capacity`` holds the master's own numbers: mounted and allocated memory in total
and per segment (each segment named by the store pod whose IP it has), objects, evictions,
and with tenancy each grant's tenant: its charge and the quota the master enforces.
Two conditions come from the same poll:

* ``Observed``: True when the master answered; False when it did not (within the poll's
  deadline), no master serves, or what answered is not a Mooncake master; Unknown when the
  operator does not ask (an external pool without ``metricsEndpoints``; a pool whose
  NetworkPolicy does not let the operator in: its pods are not known to it).
* ``Degraded``: True while fewer store pods mount memory at the master than the spec
  declares (a store down, or not yet up after a scale-up: the pool serves with less).

Scaling the stores down loses what the leaving stores hold: ``scale_down_message`` says how
much, from the last poll.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvpool.operator.master_view import MasterNumbers, Segment, TenantNumbers
from kvpool.operator.observation import Observation
from kvpool.operator.spec import DEGRADED, OBSERVED, Condition, PoolStatus, format_bytes
from kvpool.operator.status import condition, merge_conditions, phase_of


def quantity(size: int) -> str:
    """A byte count for people: ``"96Mi"``, ``"1.5Gi"`` (two significant decimals at most)."""
    for suffix, shift in (("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)):
        if size >= 1 << shift:
            exact = format_bytes(size)
            if exact.endswith(suffix):
                return exact
            return f"{size / (1 << shift):.2f}".rstrip("0").rstrip(".") + suffix
    return str(size)


def percent(part: int, whole: int) -> int:
    return round(100 * part / whole) if whole else 0


UNKNOWN = "unknown"


def used_text(tenant: TenantNumbers) -> str:
    """``"5Mi (31%)"``: charged memory and its share of the quota the master enforces."""
    return f"{quantity(tenant.charged_bytes)} ({percent(tenant.charged_bytes, tenant.effective_bytes)}%)"


def pool_grants(tenants: Mapping[str, str], observation: Observation) -> list[dict[str, Any]]:
    """``status.capacity.grants`` from a poll that answered: each grant (by name) with its
    tenant's numbers, or ``used: unknown`` when the master does not know the tenant."""
    numbers = observation.numbers
    known = numbers.tenants if numbers is not None else {}
    out: list[dict[str, Any]] = []
    for grant, tenant in sorted(tenants.items()):
        found = known.get(tenant)
        if found is None:
            out.append({"grant": grant, "tenant": tenant, "used": UNKNOWN})
        else:
            out.append(
                {
                    "grant": grant,
                    "tenant": tenant,
                    "used": used_text(found),
                    "usedBytes": found.charged_bytes,
                    "quotaBytes": found.effective_bytes,
                    "rejectedWrites": found.rejected_writes,
                }
            )
    return out


def store_segments(numbers: MasterNumbers, store_pods: dict[str, str]) -> list[Segment]:
    """The segments a store pod mounts (its IP is the segment's host)."""
    return [s for s in numbers.segments if s.host in store_pods]


def capacity_status(
    observation: Observation, expected: int | None, tenants: Mapping[str, str] | None = None
) -> dict[str, object] | None:
    """``status.capacity`` from a poll that answered (None otherwise); with ``tenants`` (grant
    name -> tenant: tenancy is on), each grant's tenant as the master counts it."""
    numbers = observation.numbers
    if numbers is None:
        return None
    pods = dict(observation.store_pods)
    mounted = len({s.host for s in store_segments(numbers, pods)})
    used = (
        f"{quantity(numbers.allocated_bytes)} ({percent(numbers.allocated_bytes, numbers.capacity_bytes)}%)"
    )
    out: dict[str, object] = {
        "changedAt": observation.at,
        "master": observation.master,
        "capacity": quantity(numbers.capacity_bytes),
        "used": used,
        "capacityBytes": numbers.capacity_bytes,
        "usedBytes": numbers.allocated_bytes,
        "usedPercent": percent(numbers.allocated_bytes, numbers.capacity_bytes),
        "objects": numbers.objects,
        "evictions": numbers.evictions,
        "evictedObjects": numbers.evicted_objects,
        "evictedBytes": numbers.evicted_bytes,
        "stores": f"{mounted}/{expected}" if expected is not None else str(len(numbers.segments)),
        "storesMounted": mounted if expected is not None else len(numbers.segments),
        "segments": [
            {
                "segment": s.name,
                **({"pod": pods[s.host]} if s.host in pods else {}),
                "capacityBytes": s.capacity_bytes,
                "usedBytes": s.allocated_bytes,
            }
            for s in numbers.segments
        ],
    }
    if expected is not None:
        out["storesExpected"] = expected
    if tenants:
        out["grants"] = pool_grants(tenants, observation)
    return out


NOT_ADMITTED = (
    "not asked: the operator's pods are not known to it (--operator-namespace, "
    "--operator-pod-label), so the pool's NetworkPolicy does not let it reach the master"
)
NO_ENDPOINTS = "not asked: spec.external.metricsEndpoints names no master HTTP port"


def observed_condition(asked: bool, observation: Observation | None, external: bool) -> Condition:
    """``Observed``: whether the master's own numbers are in the status."""
    if not asked:
        return condition(OBSERVED, None, "NotAsked", NO_ENDPOINTS if external else NOT_ADMITTED)
    if observation is None:
        return condition(OBSERVED, None, "NotYet", "the master has not been asked yet")
    if observation.numbers is None:
        return condition(OBSERVED, False, observation.reason, observation.problem or "")
    return condition(OBSERVED, True, "Answered", f"the master at {observation.master} answers")


def degraded_condition(observation: Observation | None, expected: int | None) -> Condition:
    """``Degraded``: True while fewer store pods mount memory than the spec declares."""
    if expected is None:
        return condition(DEGRADED, False, "NotCounted", "no store pods declared (embedded or external)")
    if observation is None or observation.numbers is None:
        return condition(DEGRADED, None, "NotObserved", "the master's numbers are not known")
    pods = dict(observation.store_pods)
    mounted = {s.host for s in store_segments(observation.numbers, pods)}
    if len(mounted) >= expected:
        return condition(
            DEGRADED, False, "AllStoresMounted", f"{len(mounted)}/{expected} store pods mount memory"
        )
    missing = sorted(name for ip, name in pods.items() if ip not in mounted)
    if not mounted:
        return condition(
            DEGRADED, True, "NoStoreMounted", f"0/{expected} store pods mount memory at the master"
        )
    named = f" (not mounted: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''})" if missing else ""
    return condition(
        DEGRADED,
        True,
        "StoreDown",
        f"{len(mounted)}/{expected} store pods mount memory at the master{named}: the pool serves "
        f"{quantity(observation.numbers.capacity_bytes)} of what it declares",
    )


def external_conditions(
    asked: bool, observation: Observation | None, embedded: bool
) -> tuple[Condition, Condition]:
    """``MasterReady`` and ``StoreReady`` of an external pool: what its master says."""
    if not asked:
        note = "external master, not observed (no spec.external.metricsEndpoints): consumers are rolled"
        return condition("MasterReady", True, "External", note), condition(
            "StoreReady", True, "External", note
        )
    if observation is None:
        waiting = "waiting for the external master's first answer"
        return condition("MasterReady", False, "NotObserved", waiting), condition(
            "StoreReady", False, "NotObserved", waiting
        )
    if observation.numbers is None:
        problem = observation.problem or "no answer"
        return condition("MasterReady", False, observation.reason, problem), condition(
            "StoreReady", False, "NotObserved", problem
        )
    master = condition("MasterReady", True, "ExternalServes", f"{observation.master} serves")
    if embedded:
        return master, condition("StoreReady", True, "Embedded", "vLLM ranks contribute the pool's memory")
    numbers = observation.numbers
    if numbers.capacity_bytes <= 0:
        return master, condition("StoreReady", False, "NoMemory", "the external master has no memory mounted")
    return master, condition(
        "StoreReady",
        True,
        "ExternalMemory",
        f"{quantity(numbers.capacity_bytes)} mounted in {len(numbers.segments)} segment(s)",
    )


def scale_down_message(before: int, after: int, observation: Observation | None) -> str:
    """What scaling the store pods from ``before`` to ``after`` loses, from the last poll."""
    leaving = before - after
    head = (
        f"store pods {before} -> {after}: the {leaving} pod(s) the ReplicaSet controller removes "
        "take the objects in their memory with them (Mooncake keeps one copy of each object; "
        "their readers miss and recompute)"
    )
    if observation is None or observation.numbers is None:
        return head + "; how much they hold is not known (the master was not observed)"
    numbers = observation.numbers
    used = sorted(s.allocated_bytes for s in store_segments(numbers, dict(observation.store_pods)))
    if not used:
        return head + "; no store pod mounts memory at the master now"
    least, most = sum(used[:leaving]), sum(used[-leaving:])
    total = numbers.allocated_bytes

    def share(part: int) -> str:
        return f"{percent(part, total)}%" if total else "0%"

    return (
        f"{head}; at the last poll ({observation.at}) the pool held {numbers.objects} objects in "
        f"{quantity(total)}: the leaving pods hold between {quantity(least)} and {quantity(most)} "
        f"of it ({share(least)}-{share(most)}; the master counts objects per pool, not per store)"
    )


def conditions_of(
    asked: bool, observation: Observation | None, external: bool, expected: int | None
) -> Sequence[Condition]:
    """Both conditions the poll decides."""
    return (observed_condition(asked, observation, external), degraded_condition(observation, expected))


def apply_observation(
    status: Mapping[str, Any],
    old: Mapping[str, Any],
    observation: Observation | None,
    *,
    asked: bool,
    external: bool,
    expected: int | None,
    now: str,
    tenants: Mapping[str, str] | None = None,
    held: Sequence[Condition] | None = None,
) -> dict[str, Any]:
    """``status`` (a valid pool's) with ``capacity``, ``Observed``, ``Degraded`` and the phase
    they lead to. A poll that failed keeps the last numbers; a pool not asked has none. The
    same numbers keep their ``changedAt``: a pool whose master's numbers hold still is not
    written. ``held``: ``Observed`` and ``Degraded`` as the status holds them, kept in place of
    what ``observation`` says (``first_poll``: this process has not polled the master yet)."""
    kept = [
        Condition.model_validate(c)
        for c in status.get("conditions") or []
        if c.get("type") not in (OBSERVED, DEGRADED)
    ]
    new = merge_conditions(
        old.get("conditions") or [],
        list(held) if held else list(conditions_of(asked, observation, external, expected)),
        now,
        status.get("observedGeneration"),
    )
    conditions = kept + new
    capacity: Mapping[str, Any] | None = (
        capacity_status(observation, expected, tenants) if observation is not None else None
    )
    before = old.get("capacity")
    if capacity is None and asked:
        capacity = before
    elif (
        capacity is not None
        and isinstance(before, Mapping)
        and {**capacity, "changedAt": None} == {**before, "changedAt": None}
    ):
        capacity = before  # the same numbers: nothing to write
    merged = PoolStatus.model_validate(
        {
            **{k: v for k, v in status.items() if k not in ("conditions", "capacity", "phase")},
            "phase": phase_of(conditions, external),
            "capacity": capacity,
            "conditions": [c.model_dump(by_alias=True) for c in conditions],
        }
    )
    return merged.model_dump(mode="json", by_alias=True, exclude_none=True)
