"""Owned children watched: status follows a change in seconds. Leader election: of two
replicas, exactly one acts; the other takes over when it stops."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest

from kvpool.operator.app import OperatorOptions
from kvpool.operator.election import LeaseElector, LeaseLost, LeaseOptions, micro_time
from kvpool.operator.kube import ApiError
from kvpool.operator.merge_patch import apply_merge_patch as merge_patch
from kvpool.operator.names import POOLS
from kvpool.operator.rbac import LEASE_RULES, RULES, allowed, request_permission
from testing.kube_api import (
    DEPLOYMENTS_PATH,
    NAMESPACE,
    ApiServer,
    Cluster,
    OperatorThread,
    by_operator,
    emulated_cluster,
    eventually,
    quick_options,
    write_kubeconfig,
)
from testing.operator_objects import Operator, converge, kv_flags, pool_manifest, vllm_deployment

pytestmark = pytest.mark.asyncio
LEASE_NAMESPACE = "kvpool-system"


@pytest.mark.parametrize("operator_config", [{"resync_interval": 300.0}])
async def test_status_follows_a_child_within_seconds(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest())
    await eventually(
        lambda: cluster.get(DEPLOYMENTS_PATH, "pool-store"), what="the store is created", timeout=15
    )
    # No resync for 300 s: only a watch on the pool's Deployments can see them become available.
    cluster.settle()
    await eventually(
        lambda: cluster.condition("pool", "StoreReady").get("status") == "True", what="StoreReady", timeout=10
    )
    await eventually(
        lambda: kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm")), what="consumer rolled", timeout=10
    )
    await eventually(
        lambda: cluster.settle() or cluster.pool_status("pool").get("phase") == "Ready",
        what="Ready",
        timeout=10,
    )


def lease_holder(cluster: Cluster) -> str | None:
    for (resource, namespace, name), obj in list(cluster.api.objects.items()):
        if resource.plural == "leases" and (namespace, name) == (LEASE_NAMESPACE, "kvpool-operator"):
            return None if obj.deleted else (obj.raw.get("spec") or {}).get("holderIdentity")
    return None


def replica(
    cluster: Cluster, tmp_path: Path, identity: str, lease_duration: float = 3.0, renew_deadline: float = 2.0
) -> OperatorThread:
    election = LeaseOptions(
        LEASE_NAMESPACE,
        identity=identity,
        lease_duration=lease_duration,
        renew_deadline=renew_deadline,
        retry_period=0.2,
    )
    kubeconfig = write_kubeconfig(tmp_path / identity, cluster.url)
    return OperatorThread(OperatorOptions(**quick_options(kubeconfig, leader_election=election)))


async def answers(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            return response.status == 200
    except aiohttp.ClientError:
        return False


def pool_watches(cluster: Cluster, start: int) -> int:
    return sum(
        1
        for r in cluster.requests(start)
        if r.action == kmock.action.WATCH and r.resource is not None and r.resource.plural == POOLS.plural
    )


@contextlib.asynccontextmanager
async def own_cluster() -> AsyncIterator[Cluster]:
    """An emulated API of this test's own (not the ``cluster`` fixture: the chart's RBAC check
    replays those scenarios with the operator's rules, and the Lease is granted apart)."""
    async with emulated_cluster() as cluster:
        yield cluster


async def test_of_two_replicas_one_acts_and_the_other_takes_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    async with own_cluster() as cluster:
        await two_replicas(cluster, tmp_path)


async def two_replicas(cluster: Cluster, tmp_path: Path) -> None:
    start = cluster.mark()
    # The production Lease timings: a loaded machine may hold an emulated API's answer for
    # seconds, and a renewal not done within the renew deadline ends the leader (by design).
    first, second = (replica(cluster, tmp_path, name, 15.0, 10.0) for name in ("a", "b"))
    first.start()
    try:
        await eventually(lambda: lease_holder(cluster) == "a", what="a holds the lease", timeout=15)
        second.start()
        # The standby answers its liveness probe and acts on nothing.
        for _ in range(50):
            if await answers(str(second.options.liveness_endpoint)):
                break
            await asyncio.sleep(0.1)
        assert await answers(str(second.options.liveness_endpoint))
        await cluster.create(vllm_deployment())
        await cluster.create(pool_manifest())
        await converge(cluster, generation=1)
        assert lease_holder(cluster) == "a"
        assert pool_watches(cluster, start) == 1

        # a stops (a rolling update, a drain): it gives the lease up and b acts at once.
        await first.stop()
        await eventually(lambda: lease_holder(cluster) == "b", what="b takes over", timeout=10)
        await cluster.patch_pool("pool", {"spec": {"master": {"leaseTtlMs": 9000}}})
        await converge(cluster, generation=2)
    finally:
        for thread in (first, second):
            if thread.alive:
                await thread.stop()
    assert first.error is None and second.error is None
    # Every request is one the chart's rules allow (the Lease: the Role in the operator's namespace).
    for request in cluster.requests():
        permission = request_permission(request.method, str(request.url))
        assert permission is None or allowed(permission, RULES + LEASE_RULES), request.url


class GatedApiServer(ApiServer):
    """The emulated API server that, once ``close_gate`` is called, keeps every request of the
    operator's but those on its Lease waiting until the gate opens (an API server that stalls)."""

    def close_gate(self) -> None:
        self.__dict__["gate"] = asyncio.Event()

    def open_gate(self) -> None:
        if self.__dict__.get("gate") is not None:
            self.__dict__["gate"].set()

    @property
    def waiting(self) -> int:
        return int(self.__dict__.get("waiting", 0))

    async def _handle(self, request: kmock.Request) -> Any:
        gate: asyncio.Event | None = self.__dict__.get("gate")
        leases = request.resource is not None and request.resource.plural == "leases"
        if gate is not None and not gate.is_set() and by_operator(request) and not leases:
            self.__dict__["waiting"] = self.waiting + 1
            await gate.wait()
        return await super()._handle(request)


async def test_a_leader_that_loses_the_lease_stops_acting_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leader that finds its Lease taken cancels every handler and timer under way at once: a
    pass that waits on the API never goes on to write, though kopf's own stop would let it run
    on for seconds (5 s for a timer's pass, 5 s more for any task), past the moment another
    replica may act."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    async with emulated_cluster(GatedApiServer) as cluster:
        api: GatedApiServer = cluster.api  # type: ignore[assignment]
        # A Lease long enough that a loaded machine's stalls never lose it before it is taken.
        leader = replica(cluster, tmp_path, "a", lease_duration=8.0, renew_deadline=6.0)
        duration = leader.options.leader_election.lease_duration  # type: ignore[union-attr]
        leader.start()
        try:
            await eventually(lambda: lease_holder(cluster) == "a", what="a holds the lease", timeout=15)
            await cluster.create(vllm_deployment())
            await cluster.create(pool_manifest())
            await converge(cluster, generation=1)
            api.close_gate()
            # A resync pass (every 0.5 s) waits on the API; once answered, it would put a hand
            # edit back.
            await eventually(lambda: api.waiting, what="a pass waits on the API", timeout=10)
            store = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/pool-store"
            headers = {"Content-Type": "application/merge-patch+json"}
            response = await cluster.api.patch(store, json={"spec": {"replicas": 0}}, headers=headers)
            assert response.status == 200, await response.text()
            # Another replica holds the Lease now (as after a renewal that hung past its deadline).
            taken = cluster.mark()
            lease = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/kvpool-operator"
            spec = {"holderIdentity": "b", "renewTime": micro_time(), "leaseDurationSeconds": 3600}
            response = await cluster.api.patch(lease, json={"spec": spec}, headers=headers)
            assert response.status == 200, await response.text()
            # It stops within the Lease's duration (the least a standby waits to take it over).
            for _ in range(int(duration / 0.05)):
                if not leader.alive:
                    break
                await asyncio.sleep(0.05)
            stopped_in_time = not leader.alive
            api.open_gate()  # the API answers again: a replica still acting would go on
            await leader.stop()
        finally:
            api.open_gate()
            if leader.alive:
                await leader.stop()
        assert isinstance(leader.error, LeaseLost), repr(leader.error)
        # (A renewal sent as the Lease was taken is refused: it names the version it read.)
        assert [r for r in cluster.writes(taken) if r.resource is None or r.resource.plural != "leases"] == []
        assert cluster.get(DEPLOYMENTS_PATH, "pool-store")["spec"]["replicas"] == 0  # nobody put it back
        assert stopped_in_time


class FakeLeases:
    """A Lease store with resourceVersions and 409 on a stale write (the API server's rules)."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0

    def _stored(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.lease = obj
        return copy.deepcopy(obj)

    async def get(self, resource: Any, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.lease)

    async def create(self, resource: Any, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
        if self.lease is not None:
            raise ApiError(409, "AlreadyExists")
        return self._stored(copy.deepcopy(obj))

    async def patch(self, resource: Any, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        assert self.lease is not None
        if patch["metadata"]["resourceVersion"] != self.lease["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict")
        return self._stored(merge_patch(self.lease, patch))


async def test_a_lease_its_holder_stopped_renewing_is_taken_over_after_its_duration() -> None:
    now = [0.0]
    leases = FakeLeases()
    options = {"lease_duration": 3.0, "renew_deadline": 2.0, "retry_period": 0.01}
    a = LeaseElector(leases, LeaseOptions("ns", identity="a", **options), clock=lambda: now[0])  # type: ignore[arg-type]
    b = LeaseElector(leases, LeaseOptions("ns", identity="b", **options), clock=lambda: now[0])  # type: ignore[arg-type]
    assert await a.try_acquire()
    assert not await b.try_acquire()
    now[0] = 2.0  # a renews no more (a crashed replica): b waits out the lease's duration, on its own clock
    assert not await b.try_acquire()
    now[0] = 5.5
    assert await b.try_acquire()
    assert leases.lease is not None and leases.lease["spec"]["holderIdentity"] == "b"
    assert leases.lease["spec"]["leaseTransitions"] == 1
    with pytest.raises(LeaseLost):
        await a.hold()  # a, back, renewed nothing within its deadline: it stops acting
    await b.release()
    assert "holderIdentity" not in leases.lease["spec"]
    assert await a.try_acquire()


class HangingLeases(FakeLeases):
    """A Lease store whose ``call`` (``get`` or ``patch``) never answers once ``hang`` is set, as
    an API server that accepted the request and stalls; it counts the calls cancelled."""

    def __init__(self, call: str) -> None:
        super().__init__()
        self.call, self.hang, self.cancelled = call, False, 0

    async def _stall(self) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def get(self, resource: Any, namespace: str, name: str) -> dict[str, Any] | None:
        if self.hang and self.call == "get":
            await self._stall()
        return await super().get(resource, namespace, name)

    async def patch(self, resource: Any, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        if self.hang and self.call == "patch":
            await self._stall()
        return await super().patch(resource, namespace, name, patch)


@pytest.mark.parametrize("call", ["get", "patch"])
async def test_a_renewal_that_hangs_loses_the_lease_before_a_standby_may_take_it(call: str) -> None:
    """Each of a renewal's calls may take the client's whole request timeout (30 s), longer
    than the Lease lasts: the holder gives up when its renew deadline passes, cancelling the
    call, and stops acting before a standby may take the Lease over."""
    leases = HangingLeases(call)
    options = LeaseOptions("ns", identity="a", lease_duration=3.0, renew_deadline=1.0, retry_period=0.2)
    elector = LeaseElector(leases, options)  # type: ignore[arg-type]
    assert await elector.try_acquire()
    leases.hang = True
    with pytest.raises(LeaseLost, match="not renewed within"):
        # A deadline, not a speed: the standby may take the Lease once its duration is over.
        await asyncio.wait_for(elector.hold(), options.lease_duration)
    assert leases.cancelled == 1


async def test_the_cli_turns_leader_election_on() -> None:
    from kvpool.operator.cli import _parser, options_from_args

    assert options_from_args(_parser().parse_args(["run"])).leader_election is None
    args = ["run", "--leader-election-namespace", LEASE_NAMESPACE, "--leader-election-id", "ops"]
    election = options_from_args(_parser().parse_args(args)).leader_election
    assert election is not None and (election.namespace, election.name) == (LEASE_NAMESPACE, "ops")
