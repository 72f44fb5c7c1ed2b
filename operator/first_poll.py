"""Until an operator process has polled a pool's master once, what the status holds stands (pure).

The master's last answer lives in the operator's memory only: a restarted operator, or a
standby that took the Lease over, has none until its observation timer's first poll (its
first tick comes ``min(1, observe_interval)`` s after the start, and a poll takes up to
``observe_timeout``). Its first passes come sooner. Decided from "no answer yet", they would
write ``Observed`` and ``Degraded`` Unknown and, for an external pool with metrics endpoints,
``MasterReady``/``StoreReady`` False (``NotObserved``): for those seconds the phase moves
(``Degraded`` -> ``Ready``, with a ``PoolRecovered`` Event, and back), the pod-admission
webhook refuses consumers not yet running the pool's settings, and alerts see a blip.

So a pass keeps those conditions as the status holds them (reason, message, transition
time) while the process has not polled the pool's master yet, but only

* when the status already holds each of them (a pool never observed says ``NotObserved``),
* for the spec generation they were written for (a spec changed while no operator ran may
  name another master: its old answer vouches for nothing), and
* within :func:`first_poll_bound` of the first pass that found no poll: a poll that does
  not come is news, and the status says so as before. The poll ends the hold either way,
  answered or not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from kvpool.operator.spec import DEGRADED, OBSERVED, Condition

# What the poll decides for every observed pool, and what it decides for an external one.
POLL_CONDITIONS: Final = (OBSERVED, DEGRADED)
EXTERNAL_CONDITIONS: Final = ("MasterReady", "StoreReady")


def first_poll_bound(observe_interval: float, observe_timeout: float) -> float:
    """Seconds a process keeps a pool's conditions for its first poll: by then the timer's
    first tick (at ``min(1, observe_interval)``) and the one after it (a tick that failed,
    e.g. on an API error, is tried again one interval later) have each had a whole poll's
    ``observe_timeout``. No longer: past it, the missing answer is what the status says."""
    return min(1.0, observe_interval) + observe_interval + observe_timeout


def holds_for_first_poll(
    *,
    asked: bool,
    polled: bool,
    waited: float,
    bound: float,
    status: Mapping[str, Any],
    generation: int | None,
) -> bool:
    """Whether a pass keeps the conditions the poll decides as ``status`` holds them: the
    pool's master is asked (``asked``), this process has not polled it yet (``polled``), for
    ``waited`` < ``bound`` seconds so far, and ``status`` describes this spec ``generation``."""
    current = generation is not None and status.get("observedGeneration") == generation
    return asked and not polled and waited < bound and current


def kept_conditions(status: Mapping[str, Any], kinds: Sequence[str]) -> tuple[Condition, ...] | None:
    """The conditions of ``kinds`` as ``status`` holds them, in that order; None unless it
    holds each one."""
    by_type = {c.get("type"): c for c in status.get("conditions") or []}
    found = [by_type.get(kind) for kind in kinds]
    if any(item is None for item in found):
        return None
    return tuple(Condition.model_validate(item) for item in found)
