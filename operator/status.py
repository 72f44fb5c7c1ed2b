"""The pool's status from what was observed: conditions, phase, per-consumer state."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.connector.contract.layout import Problem
from kvpool.operator.spec import CONDITION_TYPES, Condition, ConsumerStatus, PoolStatus
from kvpool.operator.validation import describe


@dataclass(frozen=True)
class Progress:
    """Whether a Deployment's current generation is fully rolled out, and why not."""

    done: bool
    message: str


def deployment_progress(deployment: Mapping[str, Any] | None) -> Progress:
    """Done only when the controller saw this generation and updated = available = desired."""
    if deployment is None:
        return Progress(False, "the Deployment does not exist")
    generation = deployment.get("metadata", {}).get("generation")
    status = deployment.get("status") or {}
    observed = status.get("observedGeneration")
    desired = deployment.get("spec", {}).get("replicas", 1)
    if generation is not None and (observed is None or observed < generation):
        return Progress(False, f"generation {generation} not yet observed (at {observed})")
    updated = status.get("updatedReplicas", 0)
    available = status.get("availableReplicas", 0)
    if updated == available == desired:
        return Progress(True, f"{available}/{desired} replicas updated and available")
    return Progress(False, f"{updated} updated, {available} available of {desired} replicas")


@dataclass(frozen=True)
class ConsumerState:
    """What reconciliation found for one consumer."""

    name: str
    config_hash: str | None
    layout_fingerprint: str | None
    rolled_out: bool
    message: str


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


def _phase(conditions: list[Condition]) -> str:
    by_type = {c.type: c.status for c in conditions}
    if by_type.get("ConfigValid") == "False":
        return "Invalid"
    if all(by_type.get(kind) == "True" for kind in CONDITION_TYPES):
        return "Ready"
    return "Progressing"


def _dump(status: PoolStatus) -> dict[str, Any]:
    return status.model_dump(mode="json", by_alias=True, exclude_none=True)


def invalid_status(
    problems: list[Problem], old: Mapping[str, Any], generation: int | None, now: str
) -> dict[str, Any]:
    """Status for a spec that cannot be served: ConfigValid=False; the rest as it was."""
    reason = "InvalidLayout" if any(".layout." in p.field for p in problems) else "InvalidSpec"
    kept = {c.get("type"): c for c in old.get("conditions") or []}
    conditions = [condition("ConfigValid", False, reason, describe(problems))]
    for kind in CONDITION_TYPES[1:]:
        previous = kept.get(kind)
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
                "conditions": [c.model_dump(by_alias=True) for c in merged],
                "consumers": [c.model_dump(by_alias=True) for c in consumers],
            }
        )
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
) -> dict[str, Any]:
    """Status after a successful reconcile."""
    master_progress = deployment_progress(master)
    conditions = [
        condition(
            "ConfigValid",
            True,
            "Valid",
            "spec, connector settings and consumer layouts pass the connector's checks",
        ),
        condition(
            "MasterReady",
            master_progress.done,
            "Available" if master_progress.done else "Progressing",
            master_progress.message,
        ),
    ]
    if embedded:
        conditions.append(
            condition("StoreReady", True, "Embedded", "vLLM ranks contribute the pool's memory")
        )
    else:
        store_progress = deployment_progress(store)
        conditions.append(
            condition(
                "StoreReady",
                store_progress.done,
                "Available" if store_progress.done else "Progressing",
                store_progress.message,
            )
        )
    pending = [c.name for c in consumers if not c.rolled_out]
    if not consumers:
        conditions.append(condition("ConsumersRolledOut", True, "NoConsumers", "no consumers declared"))
    elif pending:
        conditions.append(
            condition("ConsumersRolledOut", False, "RollingOut", "waiting for: " + ", ".join(pending))
        )
    else:
        conditions.append(
            condition(
                "ConsumersRolledOut",
                True,
                "RolledOut",
                f"{len(consumers)} consumer(s) run the current settings",
            )
        )
    merged = _merge(old.get("conditions") or [], conditions, now, generation)
    return _dump(
        PoolStatus.model_validate(
            {
                "observedGeneration": generation,
                "phase": _phase(merged),
                "masterAddress": master_address,
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
            }
        )
    )


def condition_of(status: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    """A condition of a status dict, by type."""
    for item in status.get("conditions") or []:
        if item.get("type") == kind:
            return item
    return None
