"""Test harness for the operator: kmock as the Kubernetes API, the real operator on it.

``ApiServer`` is kmock's stateful emulator with the little an API server adds on its own
(uid, resourceVersion, generation, generateName) and one-shot fault injection. The
operator runs in its own thread and event loop, exactly as ``kvpool-operator run`` would,
pointed at the emulator by a kubeconfig; everything binds to 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kmock

from kvpool.operator.config import OperatorConfig
from kvpool.operator.consumers import FLAG
from kvpool.operator.patching import apply as apply_patch
from kvpool.operator.rbac import allowed, request_permission
from kvpool.operator.resources import DEPLOYMENTS, POOLS, resource_of
from kvpool.operator.runner import run

NAMESPACE = "team-a"
WRITE_METHODS = {"POST", "PUT", "PATCH", "DELETE"}
OPERATOR_AGENTS = ("kopf/", "kvpool-operator/")
_SEQUENCE = itertools.count(1000)


@dataclass
class Fault:
    """Answer the operator's next ``times`` matching requests with ``status``, changing nothing."""

    method: str
    plural: str
    status: int
    times: int = 1
    name: str | None = None
    subresource: str | None = None

    def matches(self, request: kmock.Request) -> bool:
        return (
            self.times > 0
            and by_operator(request)
            and request.method.upper() == self.method
            and request.resource is not None
            and request.resource.plural == self.plural
            and (self.name is None or request.name == self.name)
            and request.subresource == self.subresource
        )


class ApiServer(kmock.KubernetesEmulator):
    """kmock's emulator plus server-side metadata and fault injection."""

    faults: list[Fault]

    def fail(self, fault: Fault) -> Fault:
        self.__dict__.setdefault("faults", []).append(fault)
        return fault

    async def _handle(self, request: kmock.Request) -> Any:
        for fault in self.__dict__.get("faults", []):
            if fault.matches(request):
                fault.times -= 1
                raise kmock.KubernetesError(
                    status=fault.status, reason="Injected", message=f"injected {fault.status}"
                )
        if request.resource is not None and isinstance(request.data, dict):
            self._stamp(request)
        return await super()._handle(request)

    def _stamp(self, request: kmock.Request) -> None:
        meta = request.data.setdefault("metadata", {})
        if request.action == kmock.action.CREATE:
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{next(_SEQUENCE)}"
            meta.setdefault("uid", f"uid-{next(_SEQUENCE)}")
            meta["resourceVersion"] = str(next(_SEQUENCE))
            meta.setdefault("generation", 1)
            meta.setdefault("creationTimestamp", "2025-01-01T00:00:00Z")
        elif request.action == kmock.action.UPDATE and request.name:
            key = (request.resource, request.namespace, request.name)
            if key not in self.objects or self.objects[key].deleted:
                return
            current = self.objects[key].raw
            meta["resourceVersion"] = str(next(_SEQUENCE))
            if request.subresource is None:
                after = apply_patch(current, request.data)
                if after.get("spec") != current.get("spec"):
                    meta["generation"] = current.get("metadata", {}).get("generation", 1) + 1


def declare_resources(api: kmock.KubernetesEmulator) -> None:
    """Teach the emulated API the builtin kinds and the ``MooncakeKVPool`` CRD."""
    from kvpool.operator.crd import build_crd

    api.resources.load_bundled()
    version = build_crd()["spec"]["versions"][0]
    api.resources[POOLS_PATH] = kmock.ResourceInfo(
        kind=POOLS.kind,
        singular="mooncakekvpool",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"},
        shortnames={"mkvp"},
        subresources=set(version["subresources"]),
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


def by_operator(request: kmock.Request) -> bool:
    agent = next((v for k, v in request.headers.items() if k.lower() == "user-agent"), "")
    return agent.startswith(OPERATOR_AGENTS)


@dataclass
class Cluster:
    """The emulated API server and the test's view of it."""

    api: ApiServer

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

    async def passes(self, pool: str, start: int, count: int = 2) -> int:
        """Wait for ``count`` complete reconcile passes over ``pool`` after ``start``.

        Each pass begins with the operator reading the pool; passes never overlap, so
        when pass ``count + 1`` begins, the first ``count`` are done. Returns a mark
        just after that beginning.
        """
        path = POOLS.path(NAMESPACE, pool)

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

    def get(self, plural_path: str, name: str, namespace: str = NAMESPACE) -> dict[str, Any] | None:
        key = (kmock.resource(plural_path), namespace, name)
        if key not in self.api.objects or self.api.objects[key].deleted:
            return None
        return copy.deepcopy(self.api.objects[key].raw)

    def history(self, plural_path: str, name: str, namespace: str = NAMESPACE) -> list:
        return list(self.api.objects[plural_path, namespace, name].history)

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        api_version = obj["apiVersion"]
        root = f"/apis/{api_version}" if "/" in api_version else f"/api/{api_version}"
        plural = {"Deployment": "deployments", "MooncakeKVPool": POOLS.plural}[obj["kind"]]
        namespace = obj["metadata"].get("namespace", NAMESPACE)
        response = await self.api.post(f"{root}/namespaces/{namespace}/{plural}", json=obj)
        assert response.status in (200, 201), await response.text()
        return await response.json()

    async def patch_pool(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        response = await self.api.patch(
            POOLS.path(NAMESPACE, name), json=patch, headers={"Content-Type": "application/merge-patch+json"}
        )
        assert response.status == 200, await response.text()
        return await response.json()

    async def delete_pool(self, name: str) -> None:
        response = await self.api.delete(POOLS.path(NAMESPACE, name))
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
                obj.patch({"status": status})

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
        """Operator requests that the RBAC rules would refuse."""
        refused = []
        for request in self.requests():
            permission = request_permission(request.method, str(request.url))
            if permission is not None and allowed(permission) is None:
                refused.append(f"{request.method} {request.url.path}")
        return refused


POOLS_PATH = f"{POOLS.group}/{POOLS.version}/{POOLS.plural}"
DEPLOYMENTS_PATH = "apps/v1/deployments"


async def eventually(check: Callable[[], Any], timeout: float = 60.0, what: str = "") -> Any:
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
        await asyncio.sleep(0.05)


class OperatorThread:
    """The operator in its own thread and event loop, stopped through kopf's stop flag."""

    def __init__(self, config: OperatorConfig):
        self.config = config
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="kvpool-operator", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(run(self.config, stop_flag=self.stop_flag, ready_flag=self.ready_flag))
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


@dataclass
class Operator:
    """A running operator and where to reach its endpoints."""

    thread: OperatorThread
    liveness_url: str
    metrics_url: str
    webhook_url: str | None = None


def pool_manifest(name: str = "pool", spec: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": f"{POOLS.group}/{POOLS.version}",
        "kind": POOLS.kind,
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec if spec is not None else pool_spec(),
    }


def layout(*groups: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "org/model", "groups": list(groups) or [full_group()], **extra}


def full_group(block_size: int = 16) -> dict[str, Any]:
    return {"kind": "full", "block_size": block_size}


def pool_spec(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "image": "registry.example/mooncake:0.3.13",
        "store": {"segmentSize": "1GB", "replicas": 2},
        "connector": {"cache_prefix": "team-a"},
        "consumers": [
            {
                "name": "llm",
                "container": "vllm",
                "layout": layout(
                    full_group(), {"kind": "sliding_window", "block_size": 16, "sliding_window": 4096}
                ),
            }
        ],
    }
    spec.update(overrides)
    return spec


ORIGINAL_KV_CONFIG = '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'


def vllm_deployment(name: str = "llm") -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app": name}},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "containers": [
                        {
                            "name": "vllm",
                            "image": "vllm/vllm-openai:v0.11.0",
                            "args": [
                                "--model",
                                "org/model",
                                "--kv-transfer-config",
                                ORIGINAL_KV_CONFIG,
                                "--port",
                                "8000",
                            ],
                            "env": [
                                {"name": "HF_HOME", "value": "/cache"},
                                {"name": "PYTHONHASHSEED", "value": "42"},
                            ],
                        },
                        {"name": "sidecar", "image": "busybox", "args": ["sleep", "inf"]},
                    ],
                },
            },
        },
    }


def path_of(obj: dict[str, Any]) -> str:
    resource = resource_of(obj)
    return f"{resource.api_version}/{resource.plural}"


def template(deployment: dict[str, Any] | None) -> dict[str, Any]:
    assert deployment is not None
    return deployment["spec"]["template"]


def kv_flags(deployment: dict[str, Any] | None) -> list[str]:
    container = template(deployment)["spec"]["containers"][0]
    return [a for a in container.get("args", []) if a.startswith(FLAG)]


def as_created(cluster: Cluster, name: str) -> dict[str, Any]:
    first = cluster.history(DEPLOYMENTS_PATH, name)[0]
    return copy.deepcopy(first.raw)


async def converge(cluster: Cluster, name: str = "pool", generation: int | None = None) -> dict:
    """Play the Deployment controller until the pool is Ready (at ``generation``) and
    kopf has finished handling its spec."""

    def ready() -> dict[str, Any] | None:
        cluster.settle()
        status = cluster.pool_status(name)
        if status.get("phase") != "Ready":
            return None
        if generation is not None and status.get("observedGeneration") != generation:
            return None
        return status if cluster.handled(name) else None

    return await eventually(ready, what=f"{name} is Ready")
