"""The Deployment and StatefulSet controllers of the test node, as pure functions.

Each takes a workload and the pods it has (:class:`PodView`) and returns what to do next
(:class:`Actions`: pods to create, pods to delete) and the status a real controller would
write. One step at a time, called again whenever anything changes:

* Deployment: ``Recreate`` deletes every old pod and creates new ones once they are gone;
  ``RollingUpdate`` keeps at most ``replicas + maxSurge`` pods and at least
  ``replicas - maxUnavailable`` available ones (unready old pods go first), as the
  Deployment controller does across its ReplicaSets. Status: ``replicas`` (pods not
  terminating, old ones included), ``updatedReplicas``, ``readyReplicas``,
  ``availableReplicas``, ``unavailableReplicas``, ``observedGeneration`` and the
  ``Available``/``Progressing`` conditions; zero counts are left out, as the API does.
* StatefulSet: pods ``<name>-<ordinal>`` with stable names and hostnames, created in order
  (``OrderedReady``: each once the ones before it are ready) or all at once (``Parallel``),
  removed from the highest ordinal, rolled from the highest ordinal one at a time.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

REVISION_LABEL = "pod-template-hash"
STATEFUL_REVISION_LABEL = "controller-revision-hash"


@dataclass(frozen=True)
class PodView:
    """What a controller needs of one of its pods."""

    name: str
    revision: str
    ready: bool
    available: bool
    terminating: bool = False


@dataclass(frozen=True)
class Actions:
    """Pods to create (a count, or StatefulSet names) and pods to delete (names)."""

    create: int = 0
    create_names: tuple[str, ...] = ()
    delete: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    actions: Actions
    status: dict[str, Any] = field(default_factory=dict)


def revision(template: Mapping[str, Any]) -> str:
    """A pod template's revision: a short digest of the whole template."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def _scaled(value: int | str | None, replicas: int, default: str, round_up: bool) -> int:
    """``maxSurge``/``maxUnavailable``: an int, or a percentage of ``replicas``."""
    value = default if value is None else value
    if isinstance(value, str) and value.endswith("%"):
        exact = replicas * int(value[:-1]) / 100
        return math.ceil(exact) if round_up else math.floor(exact)
    return int(value)


def _drop_zero(status: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in status.items() if v not in (0, None)}


def _scale(current: Sequence[PodView], replicas: int) -> Actions:
    """Bring pods of one revision to ``replicas``: create the missing, delete the extra
    (not-ready ones first, then the newest)."""
    if len(current) < replicas:
        return Actions(create=replicas - len(current))
    extra = len(current) - replicas
    order = sorted(current, key=lambda p: (p.ready, p.name), reverse=False)
    return Actions(delete=tuple(p.name for p in order[:extra]))


def deployment_plan(deployment: Mapping[str, Any], pods: Sequence[PodView]) -> Plan:
    """The next step of a Deployment's rollout and its status."""
    spec = deployment.get("spec") or {}
    replicas = int(spec.get("replicas", 1))
    current = revision(spec.get("template") or {})
    active = [p for p in pods if not p.terminating]
    new = [p for p in active if p.revision == current]
    old = [p for p in active if p.revision != current]
    strategy = spec.get("strategy") or {}
    if strategy.get("type") == "Recreate":
        max_unavailable = replicas
        if old:
            actions = Actions(delete=tuple(p.name for p in old))
        elif any(p.terminating and p.revision != current for p in pods):
            actions = Actions()  # Recreate: new pods only once the old ones are gone
        else:
            actions = _scale(new, replicas)
    else:
        rolling = strategy.get("rollingUpdate") or {}
        surge = _scaled(rolling.get("maxSurge"), replicas, "25%", round_up=True)
        max_unavailable = _scaled(rolling.get("maxUnavailable"), replicas, "25%", round_up=False)
        if surge == 0 and max_unavailable == 0:
            max_unavailable = 1
        actions = _rolling(new, old, replicas, surge, max_unavailable) if old else _scale(new, replicas)
    available = sum(p.available for p in active)
    done = len(new) == replicas == len(active) and available == replicas
    status = {
        "observedGeneration": (deployment.get("metadata") or {}).get("generation"),
        "replicas": len(active),
        "updatedReplicas": len(new),
        "readyReplicas": sum(p.ready for p in active),
        "availableReplicas": available,
        "unavailableReplicas": max(0, len(active) - available),
    }
    enough = available >= replicas - max_unavailable
    conditions = [
        _condition(
            "Available", enough, "MinimumReplicasAvailable" if enough else "MinimumReplicasUnavailable"
        ),
        _condition("Progressing", True, "NewReplicaSetAvailable" if done else "ReplicaSetUpdated"),
    ]
    return Plan(actions, {**_drop_zero(status), "conditions": conditions})


def _rolling(
    new: Sequence[PodView], old: Sequence[PodView], replicas: int, surge: int, max_unavailable: int
) -> Actions:
    total = len(new) + len(old)
    create = max(0, min(replicas - len(new), replicas + surge - total))
    min_available = replicas - max_unavailable
    new_unavailable = sum(not p.available for p in new)
    room = total - min_available - new_unavailable
    delete: list[str] = []
    if room > 0:
        delete += [p.name for p in old if not p.available][:room]
        available = sum(p.available for p in [*new, *old])
        healthy = [p.name for p in old if p.available]
        delete += healthy[: max(0, min(available - min_available, room - len(delete)))]
    return Actions(create=create, delete=tuple(delete))


def _condition(kind: str, ok: bool, reason: str) -> dict[str, Any]:
    return {"type": kind, "status": "True" if ok else "False", "reason": reason}


def stateful_plan(statefulset: Mapping[str, Any], pods: Sequence[PodView]) -> Plan:
    """The next step of a StatefulSet and its status."""
    meta, spec = statefulset.get("metadata") or {}, statefulset.get("spec") or {}
    name = meta["name"]
    replicas = int(spec.get("replicas", 1))
    current = revision(spec.get("template") or {})
    parallel = spec.get("podManagementPolicy") == "Parallel"
    by_name = {p.name: p for p in pods}
    wanted = [f"{name}-{i}" for i in range(replicas)]
    create: list[str] = []
    for ordinal, pod_name in enumerate(wanted):
        if pod_name in by_name:
            continue
        if parallel or all(by_name.get(n) is not None and by_name[n].ready for n in wanted[:ordinal]):
            create.append(pod_name)
        if not parallel:
            break
    extra = sorted(
        (p for p in pods if p.name not in wanted and not p.terminating),
        key=lambda p: int(p.name.rsplit("-", 1)[1]),
        reverse=True,
    )
    delete = [p.name for p in (extra if parallel else extra[:1])]
    strategy = (spec.get("updateStrategy") or {}).get("type", "RollingUpdate")
    settled = not create and not extra and all(by_name[n].ready for n in wanted if n in by_name)
    if strategy == "RollingUpdate" and settled and not any(p.terminating for p in pods):
        stale = [n for n in reversed(wanted) if n in by_name and by_name[n].revision != current]
        delete += stale[:1]
    active = [p for p in pods if not p.terminating]
    updated = sum(p.revision == current for p in active)
    status = {
        "observedGeneration": meta.get("generation"),
        "replicas": len(active),
        "readyReplicas": sum(p.ready for p in active),
        "availableReplicas": sum(p.available for p in active),
        "currentReplicas": updated,
        "updatedReplicas": updated,
        "currentRevision": f"{name}-{current}",
        "updateRevision": f"{name}-{current}",
    }
    return Plan(Actions(create_names=tuple(create), delete=tuple(delete)), _drop_zero(status))
