"""Scaling the store pods down without losing what they hold: drain them first (pure).

Mooncake keeps one copy of each object, in the memory of the store that holds it. Lowering
``spec.store.replicas`` straight away loses what the pods the ReplicaSet controller removes
hold. With ``spec.store.drainTimeoutSeconds`` > 0 the operator instead:

1. keeps the store Deployment at its current count and writes ``status.storeDrain``
   (``Pending``), in the pass that sees the lower count;
2. in its observation timer, picks the leaving pods (the emptiest segments by the master's
   own numbers, each mapped to its pod by IP) and asks the master for a drain job
   (``drain_jobs``): the master places no new object on their segments and moves what they
   hold to the other stores (``Draining``), then marks them ``DRAINED`` (``Drained``);
3. the drained pods' readiness probe fails (``store_probe``: the master says their segment is
   drained), and once none of them is ready and every other store pod is, the pass applies
   the lower count: the ReplicaSet controller removes pods that are not ready first, i.e.
   exactly the drained ones, and the Event ``StoreScaleDown`` says that nothing was lost.

The drain has a deadline (``drainTimeoutSeconds`` from the pass that started it). Past it, or
when the master refuses or fails the job, the timer cancels the job (the segments take
writes again) and the drain is ``GivenUp``: the pass applies the lower count as it would
without a drain, and the Event says what is lost. Raising ``replicas`` back while the drain
runs calls it off (``Withdrawn``: the timer cancels the job). A pool whose master the
operator does not observe, a scale-down to zero (nowhere to move to) and embedded pools
(no store pods) scale down at once; with HA masters the job goes to the leader. Nothing
here waits: each step is one pass or one timer run, and the state lives in the status, so a
restarted operator goes on where it was.
"""

from __future__ import annotations

import datetime
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvpool.operator.capacity import quantity, store_segments
from kvpool.operator.observation import Observation
from kvpool.operator.plan import Plan
from kvpool.operator.spec import StoreDrainStatus
from kvpool.operator.status import TIME_FORMAT

PENDING: Final = "Pending"
DRAINING: Final = "Draining"
DRAINED: Final = "Drained"
GIVEN_UP: Final = "GivenUp"
WITHDRAWN: Final = "Withdrawn"


def parse_time(value: str) -> datetime.datetime:
    return datetime.datetime.strptime(value, TIME_FORMAT).replace(tzinfo=datetime.UTC)


def later(now: str, seconds: int) -> str:
    """``now`` plus ``seconds``, in the status's time format."""
    return (parse_time(now) + datetime.timedelta(seconds=seconds)).strftime(TIME_FORMAT)


def past(deadline: str, now: str) -> bool:
    return parse_time(now) >= parse_time(deadline)


def record_of(status: Mapping[str, Any]) -> StoreDrainStatus | None:
    """``status.storeDrain``, or None."""
    raw = status.get("storeDrain")
    return StoreDrainStatus.model_validate(raw) if raw else None


def new_record(**fields: Any) -> StoreDrainStatus:
    """A ``status.storeDrain`` from its fields' Python names."""
    return StoreDrainStatus.model_validate(fields, by_name=True)


def dump(record: StoreDrainStatus | None) -> dict[str, Any] | None:
    return None if record is None else record.model_dump(by_alias=True, exclude_none=True)


@dataclass(frozen=True)
class StoreScale:
    """What a pass applies: the store replicas (``before``: the live Deployment's count),
    ``status.storeDrain`` after it, the drain this pass ends by applying its lower count, and
    the drained pods still ready when it did (past the deadline)."""

    replicas: int | None
    before: int | None = None
    drain: StoreDrainStatus | None = None
    ended: StoreDrainStatus | None = None
    stayed_ready: tuple[str, ...] = ()
    # Pods that stay, not ready when the lower count was applied (past the deadline).
    unready_kept: tuple[str, ...] = ()
    begins: bool = False  # this pass starts the drain (``drain`` is its Pending record)

    @property
    def warns(self) -> bool:
        """Whether the controller may remove other pods than the drained ones."""
        return bool(self.stayed_ready or self.unready_kept)


def store_scale(
    plan: Plan,
    before: int | None,
    record: StoreDrainStatus | None,
    observation: Observation | None,
    ready_pods: Collection[str],
    now: str,
    unready_pods: Collection[str] = (),
) -> StoreScale:
    """The store replicas a pass applies. ``before``: the live store Deployment's count (None:
    none the pool owns); ``ready_pods`` and ``unready_pods``: the names of its store pods
    (not terminating) that are ready now, and that are not.

    A drained scale-down applies the lower count once the drained pods are not ready and
    every other store pod is: the ReplicaSet controller removes pods that are not ready
    first, so exactly the drained ones go (a kept store slow to answer its probe would
    otherwise go in place of a drained one, with what it holds)."""
    wanted = plan.store_replicas
    if wanted is None:
        return StoreScale(None, before)
    if record is None:
        if before is None or wanted >= before:
            return StoreScale(wanted, before)
        if awaits_first_poll(plan, observation, wanted):
            return StoreScale(before, before)  # held until the master is asked (a pass after it drains)
        if not can_drain(plan, observation, wanted):
            return StoreScale(wanted, before)
        pending = new_record(
            state=PENDING,
            from_replicas=before,
            to_replicas=wanted,
            started_at=now,
            deadline=later(now, plan.drain_seconds),
            message=f"store pods {before} -> {wanted}: the leaving pods are drained first",
        )
        return StoreScale(before, before, pending, begins=True)
    if record.state in (PENDING, DRAINING) and wanted >= record.from_replicas:
        called_off = f"spec.store.replicas is {wanted} again: the drain is called off"
        withdrawn = record.model_copy(update={"state": WITHDRAWN, "message": called_off})
        return StoreScale(wanted, before, withdrawn if record.job_id else None)
    if record.state == WITHDRAWN:
        # No scale-down while a called-off job is given back: a new one drains after it.
        held = wanted if before is None else max(wanted, before)
        return StoreScale(held, before, record)
    if record.state in (PENDING, DRAINING):
        return StoreScale(record.from_replicas, before, record)
    if record.state == DRAINED:
        still_ready = tuple(sorted(set(record.pods) & set(ready_pods)))
        unready_kept = tuple(sorted(set(unready_pods) - set(record.pods)))
        if (still_ready or unready_kept) and not past(record.deadline, now):
            return StoreScale(record.from_replicas, before, record)
        return StoreScale(record.to_replicas, before, None, record, still_ready, unready_kept)
    return StoreScale(record.to_replicas, before, None, record)  # GivenUp


# Pod phases of a pod whose containers have all ended: kept in the API (an evicted pod stays
# until the pod garbage collector's threshold), not counted by the ReplicaSet controller, and
# its IP may already be a new pod's.
ENDED_PHASES: Final = frozenset(("Failed", "Succeeded"))


def ended(pod: Mapping[str, Any]) -> bool:
    """Whether ``pod`` has ended (Failed, e.g. evicted, or Succeeded): it runs no store."""
    return (pod.get("status") or {}).get("phase") in ENDED_PHASES


def can_drain(plan: Plan, observation: Observation | None, wanted: int) -> bool:
    """Whether a scale-down to ``wanted`` drains first: drains are on, some pod stays to take
    the objects, and the master answered the operator's last poll."""
    answered = observation is not None and observation.answered
    return plan.drain_seconds > 0 and wanted > 0 and plan.observed and answered


def awaits_first_poll(plan: Plan, observation: Observation | None, wanted: int) -> bool:
    """Whether a scale-down to ``wanted`` would drain but this operator process has not asked
    the master yet (it just started, or just took the Lease over): the poll is kept in memory
    only, and its absence is no master that cannot be observed."""
    return observation is None and plan.drain_seconds > 0 and wanted > 0 and plan.observed


def leaving_segments(observation: Observation | None, count: int) -> list[tuple[str, str]] | None:
    """The ``count`` emptiest store segments, as (segment, pod), emptiest first; None when the
    last poll does not name that many (and one more to move to)."""
    if observation is None or observation.numbers is None:
        return None
    pods = dict(observation.store_pods)
    segments = sorted(store_segments(observation.numbers, pods), key=lambda s: (s.allocated_bytes, s.name))
    if len(segments) <= count:
        return None
    return [(s.name, pods[s.host]) for s in segments[:count]]


def drained_message(
    record: StoreDrainStatus, stayed_ready: tuple[str, ...] = (), unready_kept: tuple[str, ...] = ()
) -> str:
    """The Event of a scale-down whose leaving pods were drained."""
    message = (
        f"store pods {record.from_replicas} -> {record.to_replicas}: the master drained "
        f"{', '.join(record.pods)} first ({record.moved_objects} objects, {quantity(record.moved_bytes)} "
        "moved to the other stores; no new writes placed on them)"
    )
    if not stayed_ready and not unready_kept:
        return message + ": they are not ready, and the ReplicaSet controller removes them first"
    states = []
    if stayed_ready:
        states.append(f"{', '.join(stayed_ready)} still ready")
    if unready_kept:
        states.append(f"{', '.join(unready_kept)} (staying) not ready")
    return message + (
        f", but at the deadline {' and '.join(states)}: the ReplicaSet controller may remove other "
        "pods instead, and what those hold is lost"
    )
