"""The pool's status from what was observed: conditions, phase, per-consumer state."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.connector.contract.layout import Problem
from kvpool.operator.leader import LeaderView
from kvpool.operator.names import ANNOTATION_PAUSED
from kvpool.operator.spec import (
    CONFLICT,
    DEGRADED,
    OBSERVED,
    PAUSED,
    READY_CONDITIONS,
    Condition,
    ConsumerStatus,
    PoolStatus,
)
from kvpool.operator.validation import describe

CONFLICT_SEPARATOR = "; "
# Every time the status holds (``utcnow``, a drain's deadline): UTC, to the second.
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


@dataclass(frozen=True)
class Progress:
    """Whether a Deployment's current generation is fully rolled out, and why not."""

    done: bool
    message: str
    observed: bool = False  # the controller saw this generation
    available: int = 0
    stalled: bool = False  # the controller gave up: its progress deadline passed
    old: int = 0  # pods of an older template still running


def stall_of(deployment: Mapping[str, Any]) -> str | None:
    """Why the Deployment controller gave up on the current rollout (``Progressing=False``,
    ``ProgressDeadlineExceeded``), or None."""
    for item in (deployment.get("status") or {}).get("conditions") or []:
        if item.get("type") == "Progressing" and item.get("reason") == "ProgressDeadlineExceeded":
            return str(item.get("message") or "its progress deadline was exceeded")
    return None


def deployment_progress(deployment: Mapping[str, Any] | None) -> Progress:
    """Done only when the controller saw this generation, updated = available = desired, and
    no pod of an older template is left (``status.replicas`` counts every revision's pods:
    with surge, an old pod stays available beside the new ones until they are)."""
    if deployment is None:
        return Progress(False, "the Deployment does not exist")
    generation = deployment.get("metadata", {}).get("generation")
    status = deployment.get("status") or {}
    observed = status.get("observedGeneration")
    desired = deployment.get("spec", {}).get("replicas", 1)
    if generation is not None and (observed is None or observed < generation):
        return Progress(False, f"generation {generation} not yet observed (at {observed})")
    stalled = stall_of(deployment)
    updated = status.get("updatedReplicas", 0)
    available = status.get("availableReplicas", 0)
    # The API leaves out a zero count: no replicas at all, which means none updated either.
    old = status.get("replicas", updated) - updated
    if old > 0:
        return Progress(
            False, f"{old} old replica(s) still running beside {updated} updated", True, available, old=old
        )
    if updated == available == desired:
        return Progress(True, f"{available}/{desired} replicas updated and available", True, available)
    message = f"{updated} updated, {available} available of {desired} replicas"
    if stalled is not None:
        return Progress(False, f"{message}; stalled: {stalled}", True, available, stalled=True)
    return Progress(False, message, True, available)


@dataclass(frozen=True)
class ConsumerState:
    """What reconciliation found for one consumer."""

    name: str
    config_hash: str | None
    layout_fingerprint: str | None
    rolled_out: bool
    message: str
    refused: str | None = None  # why the pool left it alone (no consent, another pool's, ...)
    stalled: bool = False  # its rollout did not become available: the rollout stops here


def condition(kind: str, ok: bool | None, reason: str, message: str) -> Condition:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    return Condition.model_validate({"type": kind, "status": status, "reason": reason, "message": message})


def _merge(
    old: Sequence[Mapping[str, Any]], new: list[Condition], now: str, generation: int | None
) -> list[Condition]:
    """Stamp conditions; one whose status did not change keeps its transition time."""
    previous = {c.get("type"): c for c in old}
    out = []
    for item in new:
        before = previous.get(item.type) or {}
        stamp = before.get("lastTransitionTime") if before.get("status") == item.status else None
        out.append(
            item.model_copy(
                update={
                    "last_transition_time": stamp or now,
                    "observed_generation": generation,
                }
            )
        )
    return out


def merge_conditions(
    old: Sequence[Mapping[str, Any]], new: list[Condition], now: str, generation: int | None
) -> list[Condition]:
    """Stamp conditions; one whose status did not change keeps its transition time."""
    return _merge(old, new, now, generation)


def phase_of(conditions: Sequence[Condition], external: bool = False) -> str:
    """``Invalid`` > ``Conflict`` > ``Error`` (the master should serve, by its Deployment or as
    an external pool, or every HA master runs and none leads, and its own answer says it does
    not) > ``Degraded`` (ready, with fewer stores than declared) > ``Ready`` > ``Progressing``."""
    by_type = {c.type: c.status for c in conditions}
    reasons = {c.type: c.reason for c in conditions}
    if by_type.get("ConfigValid") == "False":
        return "Invalid"
    if by_type.get(CONFLICT) == "True":
        return "Conflict"
    should_serve = (
        external or by_type.get("MasterReady") == "True" or reasons.get("MasterReady") == "NoLeader"
    )
    if by_type.get(OBSERVED) == "False" and should_serve:
        return "Error"
    if all(by_type.get(kind) == "True" for kind in READY_CONDITIONS):
        return "Degraded" if by_type.get(DEGRADED) == "True" else "Ready"
    # A store down while others serve; not a pool whose stores are still starting (none mounted).
    if by_type.get(DEGRADED) == "True" and reasons.get(DEGRADED) == "StoreDown":
        return "Degraded"
    return "Progressing"


_phase = phase_of


def _dump(status: PoolStatus) -> dict[str, Any]:
    return status.model_dump(mode="json", by_alias=True, exclude_none=True)


def invalid_status(
    problems: list[Problem], old: Mapping[str, Any], generation: int | None, now: str
) -> dict[str, Any]:
    """Status for a spec that cannot be served: ConfigValid=False; the rest as it was."""
    reason = "InvalidLayout" if any(".layout." in p.field for p in problems) else "InvalidSpec"
    kept = {c.get("type"): c for c in old.get("conditions") or []}
    conditions = [condition("ConfigValid", False, reason, describe(problems))]
    for kind in (*READY_CONDITIONS[1:], CONFLICT, OBSERVED, DEGRADED):
        previous = kept.get(kind)
        if previous is None and kind in (OBSERVED, DEGRADED):
            continue
        conditions.append(
            Condition.model_validate(previous)
            if previous
            else condition(kind, None, "ConfigInvalid", "waiting for a valid spec")
        )
    merged = _merge(old.get("conditions") or [], conditions, now, generation)
    consumers = [ConsumerStatus.model_validate(c) for c in old.get("consumers") or []]
    return _dump(
        PoolStatus.model_validate(
            {
                "observedGeneration": generation,
                "phase": _phase(merged),
                "masterAddress": old.get("masterAddress"),
                "capacity": old.get("capacity"),
                "hits": old.get("hits"),
                "lastScaleDown": old.get("lastScaleDown"),
                "storeDrain": old.get("storeDrain"),
                "conditions": [c.model_dump(by_alias=True) for c in merged],
                "consumers": [c.model_dump(by_alias=True) for c in consumers],
                "warnings": list(old.get("warnings") or []),
            }
        )
    )


def paused(pool: Mapping[str, Any]) -> bool:
    """Whether the pool carries the pause annotation (``"true"``)."""
    annotations = (pool.get("metadata") or {}).get("annotations") or {}
    return str(annotations.get(ANNOTATION_PAUSED, "")).strip().lower() == "true"


def paused_status(old: Mapping[str, Any], now: str) -> dict[str, Any]:
    """Status of a paused pool: what was observed before, as it was (its observedGeneration
    too: a newer spec is not applied), and ``Paused=True``."""
    before = {c.get("type"): c for c in old.get("conditions") or []}
    kept = [Condition.model_validate(c) for kind, c in before.items() if kind != PAUSED]
    previous = before.get(PAUSED) or {}
    stamp = previous.get("lastTransitionTime") if previous.get("status") == "True" else None
    pause = condition(
        PAUSED,
        True,
        "Annotation",
        f"{ANNOTATION_PAUSED}=true: nothing is applied, rolled or patched until it is removed",
    ).model_copy(update={"last_transition_time": stamp or now})
    return _dump(
        PoolStatus.model_validate(
            {
                **{k: v for k, v in old.items() if k not in ("phase", "conditions")},
                "phase": "Paused",
                "conditions": [c.model_dump(by_alias=True) for c in [*kept, pause]],
            }
        )
    )


def conflict_reason(conflict: str) -> str:
    """The Event reason of one refusal: an object not owned, or a consumer refused."""
    return "NotOwned" if conflict.endswith("[ownership]") else "ConsumerRefused"


def conflict_condition(conflicts: Sequence[str]) -> Condition:
    """``Conflict``: True while the pool leaves alone an object it would write, naming each."""
    if not conflicts:
        return condition(
            CONFLICT, False, "NoConflicts", "the pool owns every object it writes; every consumer opted in"
        )
    reasons = {conflict_reason(c) for c in conflicts}
    reason = reasons.pop() if len(reasons) == 1 else "Conflicts"
    return condition(CONFLICT, True, reason, CONFLICT_SEPARATOR.join(conflicts))


def conflicts_of(status: Mapping[str, Any]) -> list[str]:
    """The refusals a status's ``Conflict`` condition names."""
    item = condition_of(status, CONFLICT) or {}
    if item.get("status") != "True":
        return []
    return [c for c in str(item.get("message", "")).split(CONFLICT_SEPARATOR) if c]


NOT_PROTECTED = (
    "not started: the pool's NetworkPolicy cannot be applied (see the Conflict condition), "
    "and Mooncake's admin API and the pool's memory must not be reachable without it"
)


def master_condition(
    master: Mapping[str, Any] | None,
    blocked: bool,
    ha: bool,
    leader: LeaderView | None,
    unprotected: bool = False,
) -> Condition:
    """``MasterReady``: a leader serves. A single master serves once its Deployment is rolled
    out; an HA pool needs its masters' own word that the leader serves, and no master of an
    older template left (the leader may be one, without flags the consumers' new settings
    need; one updated master not yet available does not hold it back). Without a leader:
    ``NoLeader`` once every master runs and is available (the pool should serve: an
    ``Error``), else ``Progressing``. ``unprotected``: the master is kept at 0 replicas, its
    NetworkPolicy cannot be applied."""
    if unprotected:
        return condition("MasterReady", False, "NotProtected", NOT_PROTECTED)
    if blocked:
        return condition("MasterReady", False, "Conflict", "the master Deployment is not this pool's")
    progress = deployment_progress(master)
    if not ha:
        return condition(
            "MasterReady", progress.done, "Available" if progress.done else "Progressing", progress.message
        )
    if not progress.observed:
        return condition("MasterReady", False, "Progressing", progress.message)
    if leader is None or not leader.serves:
        message = leader.message if leader is not None else "the leader was not asked"
        reason = "NoLeader" if progress.done else "Progressing"
        return condition("MasterReady", False, reason, f"{message}; masters: {progress.message}")
    if progress.old:
        return condition(
            "MasterReady",
            False,
            "MastersRolling",
            f"{leader.message}, but masters of the previous template still run: {progress.message}",
        )
    return condition("MasterReady", True, "LeaderServes", f"{leader.message}; masters: {progress.message}")


def store_condition(
    store: Mapping[str, Any] | None, blocked: bool, embedded: bool, unprotected: bool = False
) -> Condition:
    """``StoreReady``: every store pod of the current generation is available, and there is one
    at least (a store scaled to 0 holds no memory: "0/0" is not ready)."""
    if embedded:
        return condition("StoreReady", True, "Embedded", "vLLM ranks contribute the pool's memory")
    if unprotected:
        return condition("StoreReady", False, "NotProtected", NOT_PROTECTED)
    if blocked:
        return condition("StoreReady", False, "Conflict", "the store Deployment is not this pool's")
    progress = deployment_progress(store)
    if progress.done and progress.available < 1:
        return condition("StoreReady", False, "NoStorePods", "no store pod runs (0 replicas)")
    return condition(
        "StoreReady", progress.done, "Available" if progress.done else "Progressing", progress.message
    )


def pool_serves(master: Condition, store: Condition) -> bool:
    """Whether consumers may be rolled onto the pool: its master and its store serve."""
    return master.status == "True" and store.status == "True"


def consumers_condition(consumers: Sequence[ConsumerState]) -> Condition:
    """``ConsumersRolledOut``: every consumer runs the current settings; or which one the
    rollout waits for, or stopped at."""
    if not consumers:
        return condition("ConsumersRolledOut", True, "NoConsumers", "no consumers declared")
    stalled = [c for c in consumers if c.stalled]
    if stalled:
        first = stalled[0]
        return condition(
            "ConsumersRolledOut",
            False,
            "RolloutStalled",
            f"{first.name} did not become available ({first.message}); the rollout stops there",
        )
    pending = [c.name for c in consumers if not c.rolled_out]
    if pending:
        return condition("ConsumersRolledOut", False, "RollingOut", "waiting for: " + ", ".join(pending))
    return condition(
        "ConsumersRolledOut", True, "RolledOut", f"{len(consumers)} consumer(s) run the current settings"
    )


def valid_status(
    *,
    master_address: str,
    master: Mapping[str, Any] | None,
    store: Mapping[str, Any] | None,
    embedded: bool,
    consumers: list[ConsumerState],
    old: Mapping[str, Any],
    generation: int | None,
    now: str,
    ha: bool = False,
    leader: LeaderView | None = None,
    conflicts: Sequence[str] = (),
    blocked: frozenset[str] = frozenset(),
    warnings: Sequence[str] = (),
    unprotected: bool = False,
    components: tuple[Condition, Condition] | None = None,
    last_scale_down: Mapping[str, Any] | None = None,
    store_drain: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Status after a successful reconcile; ``blocked`` names the components ("master",
    "store") whose Deployment is not the pool's; ``unprotected``: master and store are not
    started, as the pool's NetworkPolicy cannot be applied; ``components``: ``MasterReady``
    and ``StoreReady`` decided elsewhere (an external pool's, from its master's answer);
    ``last_scale_down``: a scale-down of the stores this pass made (else the last one kept);
    ``store_drain``: the drain a scale-down of the stores waits for (``store_drain``), if any."""
    master_ready, store_ready = components or (
        master_condition(master, "master" in blocked, ha, leader, unprotected),
        store_condition(store, "store" in blocked, embedded, unprotected),
    )
    conditions = [
        condition(
            "ConfigValid",
            True,
            "Valid",
            "spec, connector settings and consumer layouts pass the connector's checks",
        ),
        master_ready,
        store_ready,
        consumers_condition(consumers),
    ]
    conditions.append(conflict_condition(conflicts))
    merged = _merge(old.get("conditions") or [], conditions, now, generation)
    return _dump(
        PoolStatus.model_validate(
            {
                "observedGeneration": generation,
                "phase": _phase(merged),
                "masterAddress": master_address,
                "capacity": old.get("capacity"),
                "hits": old.get("hits"),
                "lastScaleDown": last_scale_down or old.get("lastScaleDown"),
                "storeDrain": store_drain,
                "conditions": [c.model_dump(by_alias=True) for c in merged],
                "consumers": [
                    {
                        "name": c.name,
                        "configHash": c.config_hash,
                        "layoutFingerprint": c.layout_fingerprint,
                        "rolledOut": c.rolled_out,
                        "message": c.message,
                    }
                    for c in consumers
                ],
                "warnings": list(warnings),
            }
        )
    )


def condition_of(status: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    """A condition of a status dict, by type."""
    for item in status.get("conditions") or []:
        if item.get("type") == kind:
            return item
    return None
