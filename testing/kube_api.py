"""An emulated Kubernetes API with the real operator running against it (tests and benchmarks).

``ApiServer`` is kmock's stateful emulator behaving like a real API server wherever the
operator depends on it (``testing.server_side``: uid, resourceVersion and 409s on
stale writes, generation, server-side defaults, CRD pruning and defaults, the status
subresource, label selectors, 422s on immutable fields) and one-shot fault injection;
``LeanApiServer`` keeps a compact log instead of kmock's full request history, for
hundreds of pools. The operator runs in its own thread and event loop, exactly as
``kvpool-operator run`` would, pointed at the emulator by a kubeconfig. Everything binds
to 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonpatch
import jsonpointer
import kmock

from kvpool.connector.local.ports import held_port, release_port
from kvpool.operator.app import OperatorOptions, run
from kvpool.operator.crd import build_crd, build_grant_crd
from kvpool.operator.names import (
    DEPLOYMENTS,
    GRANT_SHORT_NAMES,
    GRANT_SINGULAR,
    GRANTS,
    PODS,
    POOL_SHORT_NAMES,
    POOL_SINGULAR,
    POOLS,
    ApiResource,
    api_resource_of,
)
from kvpool.operator.rbac import allowed, implied_permissions, request_permission
from testing import server_side

NAMESPACE = "team-a"
# A tenant's namespace a pool may take grants from (the operator watches it too).
TENANT_NAMESPACE = "team-b"
WRITE_METHODS = {"POST", "PUT", "PATCH", "DELETE"}
OPERATOR_AGENTS = ("kopf/", "kvpool-operator/")
POOLS_PATH = f"{POOLS.group}/{POOLS.version}/{POOLS.plural}"
GRANTS_PATH = f"{GRANTS.group}/{GRANTS.version}/{GRANTS.plural}"
DEPLOYMENTS_PATH = f"{DEPLOYMENTS.api_version}/{DEPLOYMENTS.plural}"
PODS_PATH = f"{PODS.api_version}/{PODS.plural}"
_SEQUENCE = itertools.count(1000)
WRITE_ACTIONS = {kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE}
DELETION_MARKS = ("deletionTimestamp", "deletionGracePeriodSeconds")
# Built-in resources whose status is a subresource (group, plural).
STATUS_SUBRESOURCE = {("apps", "deployments"), ("", "services"), ("policy", "poddisruptionbudgets")}


def by_operator(request: kmock.Request) -> bool:
    """Whether the operator (its own client or kopf's) sent ``request``."""
    agent = next((v for k, v in request.headers.items() if k.lower() == "user-agent"), "")
    return agent.startswith(OPERATOR_AGENTS)


def operator_request(
    request: kmock.Request, method: str, plural: str, name: str | None = None, subresource: str | None = None
) -> bool:
    """Whether ``request`` is the operator's ``method`` on ``plural`` (that object, that subresource)."""
    return (
        by_operator(request)
        and request.method.upper() == method
        and request.resource is not None
        and request.resource.plural == plural
        and (name is None or request.name == name)
        and request.subresource == subresource
    )


@dataclass
class Fault:
    """Answer the operator's next ``times`` matching requests with ``status``, changing nothing."""

    method: str
    plural: str
    status: int
    times: int = 1
    name: str | None = None
    subresource: str | None = None
    namespace: str | None = None  # None: in any namespace

    def matches(self, request: kmock.Request) -> bool:
        return (
            self.times > 0
            and operator_request(request, self.method, self.plural, self.name, self.subresource)
            and (self.namespace is None or request.namespace == self.namespace)
        )


class ApiServer(kmock.KubernetesEmulator):
    """kmock's emulator made to behave like a real API server where the operator depends on
    it (``testing.server_side``: defaults, pruning, the status subresource, 409s on
    stale writes, generation, label selectors, 422s on immutable fields and invalid
    objects), plus one-shot fault injection."""

    faults: list[Fault]

    def fail(self, fault: Fault) -> Fault:
        self.__dict__.setdefault("faults", []).append(fault)
        return fault

    @property
    def custom_resources(self) -> dict[tuple[str, str], dict[str, Any]]:
        """(group, plural) -> the CRD version's ``schema.openAPIV3Schema`` (``declare_resources``)."""
        return self.__dict__.setdefault("custom_resources", {})

    @property
    def with_status(self) -> set[tuple[str, str]]:
        """(group, plural) of the resources whose status is a subresource."""
        return self.__dict__.setdefault("with_status", set(STATUS_SUBRESOURCE))

    @property
    def _validators(self) -> dict[tuple[str, str], Any]:
        """(group, plural) -> the validator of its CRD's schema, built on first use."""
        return self.__dict__.setdefault("validators", {})

    @property
    def _write_lock(self) -> asyncio.Lock:
        return self.__dict__.setdefault("write_lock", asyncio.Lock())

    async def _handle(self, request: kmock.Request) -> Any:
        for fault in self.__dict__.get("faults", []):
            if fault.matches(request):
                fault.times -= 1
                raise kmock.KubernetesError(
                    status=fault.status, reason="Injected", message=f"injected {fault.status}"
                )
        if request.resource is None or request.action not in WRITE_ACTIONS:
            return await super()._handle(request)
        # Writes one at a time: a precondition checked here still holds when kmock stores it.
        async with self._write_lock:
            self._server_side(request)
            return await super()._handle(request)

    async def _serve_list(self, request: kmock.Request) -> Any:
        listed = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        if selector:
            listed["items"] = [
                item
                for item in listed["items"]
                if server_side.selects(selector, item.get("metadata", {}).get("labels"))
            ]
        return listed

    def _kind_of(self, request: kmock.Request) -> tuple[str, str]:
        return (request.resource.group or "", request.resource.plural or "")

    def _defaults(self, key: tuple[str, str], obj: dict[str, Any]) -> dict[str, Any]:
        """``obj`` defaulted (a custom resource also pruned, and refused 422 if its CRD's schema
        says it is invalid, as a real server does on every write, ``/status`` ones included)."""
        schema = self.custom_resources.get(key)
        if schema is None:
            return server_side.builtin_defaults(obj)
        out = server_side.custom_resource_defaults(obj, schema)
        if key not in self._validators:
            self._validators[key] = server_side.schema_validator(schema)
        problems = server_side.schema_problems(out, self._validators[key])
        if problems:
            name = out.get("metadata", {}).get("name")
            raise kmock.KubernetesError(
                status=422, reason="Invalid", message=f"{out.get('kind')} {name!r} is invalid: {problems}"
            )
        return out

    def _server_side(self, request: kmock.Request) -> None:
        """Rewrite a write request into what a real API server would store (or refuse it)."""
        key = self._kind_of(request)
        stored = None
        entry = (request.resource, request.namespace, request.name)
        if request.name is not None and entry in self.objects and not self.objects[entry].deleted:
            stored = self.objects[entry].raw
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            self._create(request.data, key)
        elif request.action == kmock.action.UPDATE and stored is not None and isinstance(request.data, dict):
            after = self._update(stored, request.data, key, request.subresource)
            request.data.clear()
            request.data.update(server_side.changes(stored, after))
        elif request.action == kmock.action.UPDATE and stored is not None and isinstance(request.data, list):
            # A JSON patch (kopf's finalizers, guarded by a ``test`` of the resourceVersion): a
            # test that fails, or an op that does not apply, is 422 as a real server answers
            # (kopf then retries on its next cycle); one that applies is stored as any write.
            try:
                target = jsonpatch.apply_patch(stored, request.data)
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
                raise kmock.KubernetesError(
                    status=422, reason="Invalid", message=f"the JSON patch does not apply: {exc}"
                ) from exc
            after = self._update(stored, server_side.changes(stored, target), key, request.subresource)
            request.data[:] = [{"op": "replace", "path": "", "value": after}]
        elif request.action == kmock.action.DELETE and stored is not None:
            self._check_fresh(stored, request.data)
            self._mark_deleting(entry, stored)

    def _mark_deleting(self, entry: tuple[Any, str | None, str], stored: dict[str, Any]) -> None:
        """Make the deletion mark of an object with finalizers a write, as a real server's is: a
        new resourceVersion and the generation bumped (kmock then sets ``deletionTimestamp``)."""
        meta = stored.get("metadata", {})
        if not meta.get("finalizers") or meta.get("deletionTimestamp"):
            return
        self.objects[entry].patch(
            {
                "metadata": {
                    "resourceVersion": str(next(_SEQUENCE)),
                    "generation": meta.get("generation", 1) + 1,
                    "deletionGracePeriodSeconds": 0,
                }
            }
        )

    def _create(self, data: dict[str, Any], key: tuple[str, str]) -> None:
        meta = data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{next(_SEQUENCE)}"
        if key in self.with_status:
            data.pop("status", None)
        created = server_side.allocate_cluster_ip(self._defaults(key, data))
        self._check_valid(created, server_side.object_problems(created))
        meta = created.setdefault("metadata", {})
        meta["uid"] = f"uid-{next(_SEQUENCE)}"
        meta["resourceVersion"] = str(next(_SEQUENCE))
        meta["generation"] = 1
        meta.setdefault("creationTimestamp", "2025-01-01T00:00:00Z")
        data.clear()
        data.update(created)

    @staticmethod
    def _check_valid(obj: dict[str, Any], causes: list[dict[str, str]]) -> None:
        """Refuse ``obj`` as a real server does (422 Invalid, the fields in ``details.causes``)."""
        if not causes:
            return
        api_version = str(obj.get("apiVersion", ""))
        raise kmock.KubernetesError(
            status=422,
            reason="Invalid",
            message=server_side.invalid_message(obj, causes),
            details={
                "name": obj.get("metadata", {}).get("name"),
                "group": api_version.rpartition("/")[0],
                "kind": obj.get("kind"),
                "causes": causes,
            },
        )

    @staticmethod
    def _check_fresh(stored: dict[str, Any], write: Any) -> None:
        reason = server_side.stale(stored, write)
        if reason is not None:
            raise kmock.KubernetesError(status=409, reason="Conflict", message=reason)

    def _update(
        self, stored: dict[str, Any], patch: dict[str, Any], key: tuple[str, str], subresource: str | None
    ) -> dict[str, Any]:
        self._check_fresh(stored, patch)
        after = server_side.merge_patch(stored, patch)
        if subresource == "status":
            after = {k: v for k, v in stored.items() if k != "status"}
            if patched := server_side.merge_patch(stored, patch).get("status"):
                after["status"] = patched
        elif key in self.with_status:
            after.pop("status", None)
            if "status" in stored:
                after["status"] = stored["status"]
        after = server_side.keep_allocated(stored, self._defaults(key, after))
        if subresource is None:
            self._check_valid(
                after, server_side.object_problems(after) + server_side.update_problems(stored, after)
            )
        meta = after.setdefault("metadata", {})
        before = stored.get("metadata", {})
        for immutable in ("uid", "creationTimestamp", "name", "namespace"):
            if immutable in before:
                meta[immutable] = before[immutable]
        for marked in DELETION_MARKS:  # set by a DELETE alone, never changed by a write
            meta.pop(marked, None)
            if marked in before:
                meta[marked] = before[marked]
        if before.get("deletionTimestamp"):
            added = set(meta.get("finalizers") or ()) - set(before.get("finalizers") or ())
            if added:
                raise kmock.KubernetesError(
                    status=422,
                    reason="Invalid",
                    message=f"metadata.finalizers: Forbidden: no new finalizers can be added if the "
                    f"object is being deleted, found new finalizers {sorted(added)}",
                )
        generation = before.get("generation", 1)
        if server_side.spec_of(after) != server_side.spec_of(stored) and subresource is None:
            generation += 1
        meta["generation"] = generation
        meta["resourceVersion"] = before.get("resourceVersion")
        if after != stored:
            meta["resourceVersion"] = str(next(_SEQUENCE))
        return after


@dataclass(frozen=True)
class Logged:
    """What ``LeanApiServer`` keeps of one request."""

    method: str
    plural: str
    name: str | None
    watch: bool
    operator: bool

    @classmethod
    def of(cls, request: kmock.Request) -> Logged:
        return cls(
            method=request.method.upper(),
            plural=request.resource.plural if request.resource is not None else request.url.path,
            name=request.name,
            watch=request.action == kmock.action.WATCH,
            operator=by_operator(request),
        )


class LeanApiServer(ApiServer):
    """An ``ApiServer`` for hundreds of pools: a compact ``log`` instead of kmock's history.

    kmock keeps every request and matches each new one against that whole history
    (quadratic: hundreds of pools time out); this keeps only the current request there.
    """

    @property
    def log(self) -> list[Logged]:
        return self.__dict__.setdefault("log", [])

    async def _handle(self, request: kmock.Request) -> Any:
        self.log.append(Logged.of(request))
        del self._requests[:-1]
        return await super()._handle(request)


def declare_resources(api: ApiServer) -> None:
    """Teach the emulated API the builtin kinds and the operator's CRDs (their schemas too)."""
    api.resources.load_bundled()
    for resource, path, crd, singular, short in (
        (POOLS, POOLS_PATH, build_crd(), POOL_SINGULAR, POOL_SHORT_NAMES),
        (GRANTS, GRANTS_PATH, build_grant_crd(), GRANT_SINGULAR, GRANT_SHORT_NAMES),
    ):
        _declare_crd(api, resource, path, crd, singular, short)


def _declare_crd(
    api: ApiServer,
    resource: ApiResource,
    path: str,
    crd: dict[str, Any],
    singular: str,
    short: tuple[str, ...],
) -> None:
    version = crd["spec"]["versions"][0]
    api.custom_resources[(resource.group, resource.plural)] = version["schema"]["openAPIV3Schema"]
    if "status" in version["subresources"]:
        api.with_status.add((resource.group, resource.plural))
    api.resources[path] = kmock.ResourceInfo(
        kind=resource.kind,
        singular=singular,
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"},
        shortnames=set(short),
        subresources=set(version["subresources"]),
    )


def write_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "kmock",
                "clusters": [{"name": "kmock", "cluster": {"server": server}}],
                "users": [{"name": "operator", "user": {"token": "test-token"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "operator"}}],
            }
        )
    )
    return path


async def eventually(
    check: Callable[[], Any], timeout: float = 60.0, what: str = "", interval: float = 0.05
) -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: BaseException | None = None
    while True:
        try:
            result = check()
            if result:
                return result
        except (AssertionError, KeyError, IndexError, TypeError, ValueError) as exc:
            last = exc
        if loop.time() > deadline:
            raise AssertionError(f"not reached in {timeout}s: {what or check} (last: {last!r})")
        await asyncio.sleep(interval)


@dataclass
class Cluster:
    """The emulated API server and the test's view of it, in one namespace."""

    api: ApiServer
    namespace: str = NAMESPACE

    @property
    def url(self) -> str:
        return str(self.api.url).rstrip("/")

    def requests(self, start: int = 0) -> list[kmock.Request]:
        """The operator's requests, from index ``start`` of all requests."""
        return [r for r in list(self.api)[start:] if by_operator(r)]

    def mark(self) -> int:
        return len(list(self.api))

    def writes(self, start: int = 0, end: int | None = None) -> list[kmock.Request]:
        """The operator's writes between two marks."""
        window = list(self.api)[start:end]
        return [r for r in window if by_operator(r) and r.method.upper() in WRITE_METHODS]

    def watching_pools(self, start: int = 0) -> bool:
        """Whether the operator has begun watching pools since mark ``start``."""
        return any(
            r.action == kmock.action.WATCH and r.resource is not None and r.resource.plural == POOLS.plural
            for r in self.requests(start)
        )

    async def passes(self, pool: str, start: int, count: int = 2) -> int:
        """Wait for ``count`` complete reconcile passes over ``pool`` after ``start``.

        Each pass begins with the operator reading the pool; passes never overlap, so
        when pass ``count + 1`` begins, the first ``count`` are done. Returns a mark
        just after that beginning.
        """
        path = POOLS.path(self.namespace, pool)

        def begun() -> int | None:
            starts = [
                index
                for index, r in enumerate(list(self.api)[start:], start)
                if r.method.upper() == "GET" and r.url.path == path and by_operator(r)
            ]
            return starts[count] + 1 if len(starts) > count else None

        return int(await eventually(begun, what=f"{count} passes over {pool}"))

    async def quiet(self, pool: str, count: int = 2) -> None:
        """Wait until ``count`` passes in a row write nothing (after retries settle)."""

        async def window() -> bool:
            start = self.mark()
            return not self.writes(start, await self.passes(pool, start, count))

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while not await window():
            assert loop.time() < deadline, f"{pool} never went quiet"

    def events(self, reason: str) -> list[dict[str, Any]]:
        """Events the operator posted with ``reason``."""
        return [
            obj.raw
            for (resource, _, _), obj in list(self.api.objects.items())
            if resource.plural == "events" and not obj.deleted and obj.raw.get("reason") == reason
        ]

    def get(self, plural_path: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        """A copy of an object as the API server holds it (in ``namespace``, default the
        operator's); None if it does not exist."""
        key = (kmock.resource(plural_path), namespace or self.namespace, name)
        if key not in self.api.objects or self.api.objects[key].deleted:
            return None
        return copy.deepcopy(self.api.objects[key].raw)

    def history(self, plural_path: str, name: str) -> list:
        return list(self.api.objects[plural_path, self.namespace, name].history)

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create an object of a kind the operator knows (in its own namespace, else the cluster's)."""
        resource = api_resource_of(obj)
        namespace = obj["metadata"].get("namespace", self.namespace)
        response = await self.api.post(resource.path(namespace), json=obj)
        assert response.status in (200, 201), await response.text()
        return await response.json()

    async def patch_pool(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        response = await self.api.patch(
            POOLS.path(self.namespace, name),
            json=patch,
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert response.status == 200, await response.text()
        return await response.json()

    async def delete_pool(self, name: str) -> None:
        response = await self.api.delete(POOLS.path(self.namespace, name))
        assert response.status == 200, await response.text()

    def settle(self) -> None:
        """Play the Deployment controller: every Deployment's generation is rolled out."""
        for (resource, _, _), obj in list(self.api.objects.items()):
            if resource.plural != DEPLOYMENTS.plural or obj.deleted:
                continue
            replicas = obj.raw.get("spec", {}).get("replicas", 1)
            status = {
                "observedGeneration": obj.raw.get("metadata", {}).get("generation", 1),
                "replicas": replicas,
                "updatedReplicas": replicas,
                "readyReplicas": replicas,
                "availableReplicas": replicas,
            }
            if obj.raw.get("status") != status:
                obj.patch({"status": status, "metadata": {"resourceVersion": str(next(_SEQUENCE))}})

    def set_pod_ready(self, name: str, ready: bool) -> None:
        """Play the kubelet: the pod is Running, and Ready as its readiness probe said (a pod
        deleted meanwhile is left alone, as a kubelet's late probe result is)."""
        obj = self.api.objects[kmock.resource(PODS_PATH), self.namespace, name]
        if obj.deleted:
            return
        status = {
            **(obj.raw.get("status") or {}),
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        }
        if obj.raw.get("status") != status:
            obj.patch({"status": status, "metadata": {"resourceVersion": str(next(_SEQUENCE))}})

    async def delete_pod(self, name: str) -> None:
        """Play the ReplicaSet controller removing a pod."""
        response = await self.api.delete(PODS.path(self.namespace, name))
        assert response.status == 200, await response.text()

    def pool_status(self, name: str) -> dict[str, Any]:
        pool = self.get(POOLS_PATH, name)
        return (pool or {}).get("status") or {}

    def handled(self, name: str) -> bool:
        """kopf is done with the pool's current spec (no handler in progress or pending)."""
        pool = self.get(POOLS_PATH, name) or {}
        annotations = pool.get("metadata", {}).get("annotations") or {}
        kopf_keys = {k for k in annotations if k.startswith(f"{POOLS.group}/")}
        done = {f"{POOLS.group}/kopf-managed", f"{POOLS.group}/last-handled-configuration"}
        last = json.loads(annotations.get(f"{POOLS.group}/last-handled-configuration", "{}"))
        return kopf_keys == done and last.get("spec") == pool.get("spec")

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        for item in self.pool_status(name).get("conditions", []):
            if item["type"] == kind:
                return item
        return {}

    def unauthorised(self) -> list[str]:
        """Operator requests that the RBAC rules (and the admission checks on them) would refuse."""
        refused = []
        for request in self.requests():
            permission = request_permission(request.method, str(request.url))
            needed = [permission] if permission is not None else []
            needed += implied_permissions(request.method, request.data)
            if any(allowed(p) is None for p in needed):
                refused.append(f"{request.method} {request.url.path}")
        return refused


class OperatorThread:
    """The operator in its own thread and event loop, stopped through kopf's stop flag."""

    def __init__(self, options: OperatorOptions):
        self.options = options
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="kvpool-operator", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(run(self.options, stop_flag=self.stop_flag, ready_flag=self.ready_flag))
        except BaseException as exc:
            self.error = exc

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def stop(self, timeout: float = 60.0) -> None:
        self.stop_flag.set()
        await asyncio.to_thread(self._thread.join, timeout)
        assert not self._thread.is_alive(), "the operator did not stop"
        release_ports(self.options)


def release_ports(options: OperatorOptions) -> None:
    """Let go of the held ports (:func:`held_port`) ``options`` names (the operator has stopped):
    the operator binds its liveness, metrics and webhook ports only once it runs."""
    ports = [options.metrics_port, options.webhook.port if options.webhook else None]
    if options.liveness_endpoint:
        ports.append(urlsplit(options.liveness_endpoint).port)
    release_port(*ports)


#: No master runs behind an emulated cluster: unless a test names one, the operator asks a
#: loopback port nothing listens on (never a cluster DNS name, which would leave this
#: machine), and once an hour, so that when a test's pool is observed does not depend on
#: how long the test takes. Tests of the observation set both.
UNSERVED_MASTER_HEALTH_URL = "http://127.0.0.1:9/health"  # the discard port: nothing listens
RARE_OBSERVE_INTERVAL_S = 3600.0


def quick_options(kubeconfig: Path, **overrides: Any) -> dict[str, Any]:
    """Run options for an operator under test: loopback endpoints on held ports (:func:`held_port`),
    quick timings."""
    return {
        "kubeconfig": str(kubeconfig),
        "liveness_endpoint": f"http://127.0.0.1:{held_port()}/healthz",
        "metrics_host": "127.0.0.1",
        "metrics_port": held_port(),
        "resync_interval": 0.5,
        "retry_delay": 0.3,
        "request_timeout": 10.0,
        "exit_timeout": None,
        "master_health_url": UNSERVED_MASTER_HEALTH_URL,
        "observe_interval": RARE_OBSERVE_INTERVAL_S,
        **overrides,
    }


@contextlib.asynccontextmanager
async def emulated_cluster(server: type[ApiServer] = ApiServer) -> AsyncIterator[Cluster]:
    """A fresh emulated API server (``server``) on 127.0.0.1 that knows the builtins and the
    CRD, until the block ends: the one cluster set-up of the operator's tests and benchmarks."""
    async with server() as api, kmock.Server(api, host="127.0.0.1"):
        declare_resources(api)
        yield Cluster(api)


@contextlib.asynccontextmanager
async def running_operator(cluster: Cluster, options: OperatorOptions) -> AsyncIterator[OperatorThread]:
    """The real operator against ``cluster`` until the block ends: started, watching pools,
    then stopped; its errors and any request the RBAC rules would refuse fail the block."""
    start = cluster.mark()
    thread = OperatorThread(options)
    thread.start()
    try:
        await eventually(
            lambda: cluster.watching_pools(start) or not thread.alive, what="the operator watches pools"
        )
        assert thread.alive, f"the operator died: {thread.error!r}"
        yield thread
    finally:
        await thread.stop()
    assert thread.error is None, repr(thread.error)
    assert cluster.unauthorised() == []


async def post_admission_review(url: str, review: dict[str, Any], timeout_s: float = 60.0) -> dict[str, Any]:
    """POST an AdmissionReview to a webhook as the API server does, waiting for it to listen;
    the whole answer (``kind``, ``response``)."""
    import aiohttp

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.post(url, json=review) as response:
                    if response.status == 200:
                        return dict(await response.json())
            except aiohttp.ClientConnectionError:
                pass
            assert loop.time() < deadline, "the webhook never answered"
            await asyncio.sleep(0.05)
