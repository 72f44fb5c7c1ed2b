"""The order a pool's teardown deletes its children in (pure).

A pool's NetworkPolicies are what keeps the rest of the cluster from its master's RPC and
unauthenticated admin port and from its stores' memory. Deleting a Deployment only starts
its pods' end (the garbage collector, then each pod's grace period), so the policies go
last: once none of the pool's master and store pods may still run, or, when some never
end (a node that does not answer), ``GUARD_WAIT_S`` after the pool's deletion began, with
a Warning that names them. A pool without NetworkPolicies (they are off) waits for nothing.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from typing import Any, Final

from kvpool.operator import names
from kvpool.operator.names import NETWORK_POLICIES, ApiResource
from kvpool.operator.plan import children_names
from kvpool.operator.store_drain import ended

# How long past the start of a pool's deletion its NetworkPolicies wait for its pods.
GUARD_WAIT_S: Final = 300


def unguarded_children(pool: str) -> list[tuple[ApiResource, str]]:
    """The children teardown deletes first: every one but the NetworkPolicies."""
    return [(resource, name) for resource, name in children_names(pool) if resource != NETWORK_POLICIES]


def guards(pool: str) -> list[tuple[ApiResource, str]]:
    """The children teardown deletes last: the NetworkPolicies."""
    return [(resource, name) for resource, name in children_names(pool) if resource == NETWORK_POLICIES]


def guarded_selectors(pool: str) -> list[str]:
    """The label selectors of the pods the pool's NetworkPolicies guard (master and store)."""
    return [names.label_selector(pool, component) for component in (names.MASTER, names.STORE)]


def _moment(value: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))


def running_pods(pods: Iterable[Mapping[str, Any]], now: str) -> list[str]:
    """The names of ``pods`` that may still run: not ended, and not past their own deletion
    deadline (a pod's ``deletionTimestamp`` is when its grace period is over)."""
    running = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        deleting = meta.get("deletionTimestamp")
        if ended(pod) or (deleting and _moment(str(deleting)) <= _moment(now)):
            continue
        running.append(str(meta.get("name")))
    return sorted(running)


def guards_wait(running: list[str], deleting_since: str, now: str) -> bool:
    """Whether the NetworkPolicies stay for now: some guarded pod may still run, and the pool's
    deletion began less than ``GUARD_WAIT_S`` ago."""
    deadline = _moment(deleting_since) + datetime.timedelta(seconds=GUARD_WAIT_S)
    return bool(running) and _moment(now) < deadline
