"""Leader election over a ``coordination.k8s.io/v1`` Lease, so several operator replicas can run
and exactly one acts.

A replica acts (runs kopf: its watches, handlers and timers) only while it holds the Lease;
a standby answers its liveness probe and waits. The holder renews the Lease every
``retry_period``; a Lease not renewed for ``lease_duration`` (measured on this replica's own
clock from when it last saw the Lease change, never from the timestamps another wrote) may
be taken over. Every write carries the Lease's ``resourceVersion``, so of two replicas that
try at once, one wins and the other gets 409. A holder that cannot renew within
``renew_deadline`` stops acting (and its process exits, to come back as a standby); one that
stops cleanly gives the Lease up at once.

Chosen over kopf's peering, which needs its own cluster-wide CRDs and pauses the other
replicas only after they have seen each other (both act meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

from kvpool.operator.kube import ApiError, KubeClient
from kvpool.operator.names import LEASE_NAME, LEASES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseOptions:
    """Where the Lease is and how it is held."""

    namespace: str
    name: str = LEASE_NAME
    identity: str = ""  # empty: $POD_NAME, else the host name
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    @property
    def holder(self) -> str:
        return self.identity or os.environ.get("POD_NAME") or socket.gethostname()


class LeaseLost(RuntimeError):
    """This replica held the Lease and could not renew it: it must stop acting."""


def micro_time(moment: datetime.datetime | None = None) -> str:
    """A Kubernetes MicroTime."""
    moment = moment or datetime.datetime.now(datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElector:
    """Acquires, renews and releases one Lease for one replica."""

    def __init__(self, kube: KubeClient, options: LeaseOptions, clock: Any = None):
        self.kube = kube
        self.options = options
        self.identity = options.holder
        self._clock = clock or asyncio.get_running_loop().time
        self._seen: tuple[str | None, float] = (None, 0.0)  # (resourceVersion, when it was seen)
        self._renewed: float | None = None  # when the last successful attempt began

    def _observe(self, lease: dict[str, Any]) -> None:
        version = lease.get("metadata", {}).get("resourceVersion")
        if version != self._seen[0]:
            self._seen = (version, self._clock())

    def _spec(self, lease: dict[str, Any], transitions: int, acquire: bool) -> dict[str, Any]:
        now = micro_time()
        spec: dict[str, Any] = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.options.lease_duration)),
            "renewTime": now,
        }
        if acquire:
            spec.update(acquireTime=now, leaseTransitions=transitions)
        return spec

    async def try_acquire(self) -> bool:
        """One attempt: whether this replica holds the Lease now."""
        began = self._clock()
        if await self._try_acquire():
            self._renewed = began
            return True
        return False

    async def _try_acquire(self) -> bool:
        namespace, name = self.options.namespace, self.options.name
        lease = await self.kube.get(LEASES, namespace, name)
        if lease is None:
            body = {
                "apiVersion": LEASES.api_version,
                "kind": LEASES.kind,
                "metadata": {"name": name, "namespace": namespace},
                "spec": self._spec({}, 0, acquire=True),
            }
            try:
                self._observe(await self.kube.create(LEASES, namespace, body))
            except ApiError as exc:
                if exc.conflict:
                    return False  # another replica created it first
                raise
            return True
        self._observe(lease)
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        expired = self._clock() - self._seen[1] > float(spec.get("leaseDurationSeconds") or 0)
        if holder and holder != self.identity and not expired:
            return False
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if holder == self.identity else 1)
        patch = {
            "metadata": {"resourceVersion": lease["metadata"].get("resourceVersion")},
            "spec": self._spec(lease, transitions, acquire=holder != self.identity),
        }
        try:
            self._observe(await self.kube.patch(LEASES, namespace, name, patch))
        except ApiError as exc:
            if exc.conflict:
                return False
            raise
        return True

    async def acquire(self, stopped: asyncio.Event) -> bool:
        """Wait until this replica holds the Lease (True) or ``stopped`` is set (False)."""
        while not stopped.is_set():
            try:
                async with asyncio.timeout(self.options.renew_deadline):
                    acquired = await self.try_acquire()
                if acquired:
                    logger.info("leader election: %s holds lease %s", self.identity, self.options.name)
                    return True
            except (TimeoutError, ApiError, OSError) as exc:
                logger.warning("leader election: cannot reach the lease: %r", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopped.wait(), self.options.retry_period)
        return False

    async def hold(self) -> None:
        """Renew the Lease until cancelled; raise ``LeaseLost`` when it cannot be renewed in time:
        when another replica holds it, or no renewal succeeded within ``renew_deadline`` of the
        last one (an attempt still under way then is cancelled)."""
        name, limit = self.options.name, self.options.renew_deadline
        while True:
            if self._renewed is None:
                raise LeaseLost(f"lease {name} is not held")
            deadline = self._renewed + limit
            await asyncio.sleep(max(0.0, min(self.options.retry_period, deadline - self._clock())))
            left = deadline - self._clock()
            if left <= 0:
                raise LeaseLost(f"lease {name} not renewed within {limit}s")
            bound = asyncio.timeout(left)
            try:
                async with bound:
                    held = await self.try_acquire()
            except (TimeoutError, ApiError, OSError) as exc:
                if bound.expired():
                    raise LeaseLost(f"lease {name} not renewed within {limit}s (a call hung)") from None
                logger.warning("leader election: renewal failed: %r", exc)
                continue
            if not held:
                raise LeaseLost(f"lease {name} is held by another replica")

    async def release(self) -> None:
        """Give the Lease up (on a clean stop), so a standby takes over at once."""
        namespace, name = self.options.namespace, self.options.name
        try:
            async with asyncio.timeout(self.options.renew_deadline):
                lease = await self.kube.get(LEASES, namespace, name)
                if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                    return
                patch = {
                    "metadata": {"resourceVersion": lease["metadata"].get("resourceVersion")},
                    "spec": {"holderIdentity": None, "leaseDurationSeconds": 1, "renewTime": micro_time()},
                }
                await self.kube.patch(LEASES, namespace, name, patch)
        except (TimeoutError, ApiError, OSError) as exc:
            logger.warning("leader election: cannot release the lease: %s", exc)
