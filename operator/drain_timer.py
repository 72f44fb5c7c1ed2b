"""One step of a store drain, taken by the operator's observation timer (``store_drain``).

Each step makes at most two calls to the pool's master (``drain_jobs``), each within
``timeout`` seconds, and returns ``status.storeDrain`` after it (None: no drain left).

A job is canceled when its deadline passes or the scale-down is called off. The master
refuses to cancel a job while a move is in flight, so a refused cancel is asked again at the
next step, for up to ``CANCEL_GRACE_S`` past the deadline. A drain called off after its job
finished goes on as ``Drained``: its pods take no writes any more, so they leave and the
Deployment then grows back to the count asked for, with new pods.
"""

from __future__ import annotations

from kvpool.operator.drain_jobs import (
    SUCCEEDED,
    DrainJob,
    DrainRefused,
    cancel_drain_job,
    create_drain_job,
    query_drain_job,
)
from kvpool.operator.observation import Observation
from kvpool.operator.spec import StoreDrainStatus
from kvpool.operator.store_drain import (
    DRAINED,
    DRAINING,
    GIVEN_UP,
    PENDING,
    WITHDRAWN,
    later,
    leaving_segments,
    past,
)

# How long past its deadline a refused cancel is asked again.
CANCEL_GRACE_S = 60
# The least time drained pods get to turn unready (their probe: 3 failures 5 s apart).
UNREADY_GRACE_S = 60


def drain_base(ha: bool, observation: Observation | None, service_base: str) -> str:
    """The master a drain job goes to: ``service_base`` (the pool's master Service); with HA
    masters, the leader the last poll answered from (a standby takes no job), when it did."""
    if ha and observation is not None and observation.answered and observation.master:
        return f"http://{observation.master}"
    return service_base


def _counts(job: DrainJob) -> dict[str, int]:
    return {"moved_objects": job.moved_objects, "moved_bytes": job.moved_bytes}


def given_up(record: StoreDrainStatus, why: str) -> StoreDrainStatus:
    """The drain is over without emptying the leaving pods: the scale-down goes on and loses
    what they hold."""
    return record.model_copy(update={"state": GIVEN_UP, "message": why})


def drained(record: StoreDrainStatus, job: DrainJob, now: str) -> StoreDrainStatus:
    """The job moved every object: the pods leave once they are not ready."""
    return record.model_copy(
        update={
            "state": DRAINED,
            **_counts(job),
            "deadline": max(record.deadline, later(now, UNREADY_GRACE_S)),
            "message": f"drained {', '.join(record.pods)}: {job.moved_objects} objects moved",
        }
    )


async def advance(
    record: StoreDrainStatus, observation: Observation | None, base: str, now: str, timeout: float
) -> StoreDrainStatus | None:
    """The drain ``record`` one step further at the master ``base`` (``http://host:port``)."""
    if record.state == PENDING:
        return await _start(record, observation, base, now, timeout)
    if record.state not in (DRAINING, WITHDRAWN) or record.job_id is None:
        return None if record.state == WITHDRAWN else record
    late = past(record.deadline, now)
    gone = past(later(record.deadline, CANCEL_GRACE_S), now)
    try:
        job = await query_drain_job(base, record.job_id, timeout)
    except DrainRefused as exc:
        if record.state == WITHDRAWN:
            return None if gone else record
        if late:
            return given_up(record, f"not drained by {record.deadline} (the master did not say: {exc})")
        return record.model_copy(update={"message": f"draining; the last ask failed: {exc}"})
    if job.status == SUCCEEDED:
        return drained(record, job, now)
    if job.finished:  # failed or canceled: the master gave the segments back
        if record.state == WITHDRAWN:
            return None
        return given_up(
            record.model_copy(update=_counts(job)),
            f"the drain job ended {job.status} ({job.message}; {job.failed_objects} objects not moved)",
        )
    if record.state == WITHDRAWN or late:
        try:
            await cancel_drain_job(base, record.job_id, timeout)
        except DrainRefused as exc:
            if not gone:
                return record.model_copy(update={**_counts(job), "message": f"canceling: {exc}"})
            why = f"the master did not cancel the job ({exc}): its segments take no writes until restarted"
        else:
            why = "the job is canceled: the segments take writes again"
        if record.state == WITHDRAWN:
            return None
        return given_up(
            record.model_copy(update=_counts(job)),
            f"not drained by {record.deadline} ({job.moved_objects} objects moved, "
            f"{job.moving_objects} moving, {job.blocked_objects} waiting); {why}",
        )
    return record.model_copy(
        update={
            **_counts(job),
            "message": f"draining {', '.join(record.pods)}: {job.moved_objects} objects moved, "
            f"{job.moving_objects} moving, {job.blocked_objects} waiting (leased or in use)",
        }
    )


async def _start(
    record: StoreDrainStatus, observation: Observation | None, base: str, now: str, timeout: float
) -> StoreDrainStatus:
    """Ask the master to drain the emptiest segments."""
    if past(record.deadline, now):
        return given_up(record, f"no drain started by {record.deadline}")
    leaving = leaving_segments(observation, record.from_replicas - record.to_replicas)
    if leaving is None:
        return given_up(
            record,
            "the master's last poll does not name the segments of enough store pods to drain "
            f"{record.from_replicas - record.to_replicas} and keep one",
        )
    segments = [segment for segment, _ in leaving]
    try:
        job_id = await create_drain_job(base, segments, timeout)
    except DrainRefused as exc:
        return given_up(record, f"the master refused the drain: {exc}")
    pods = [pod for _, pod in leaving]
    return record.model_copy(
        update={
            "state": DRAINING,
            "job_id": job_id,
            "segments": segments,
            "pods": pods,
            "message": f"draining {', '.join(pods)}: no new writes go to them; their objects move to the "
            "other stores",
        }
    )
