"""Operator: time from creating a MooncakeKVPool to its children, and 100 pools in steady state.

The real operator (kopf, its handlers, its Kubernetes client; ``kvpool.operator.runner.run``)
runs in a thread against kmock, a stateful Kubernetes API emulator over HTTP on
127.0.0.1 (no kube-apiserver can be had here), plus the little an API server
adds itself (uid, resourceVersion, generation) and a stand-in Deployment
controller that marks Deployments rolled out. Measured:

* **time to children** — from the pool's ``POST`` returning to every child the
  pure ``build_plan`` wants existing on the API server;
* **steady state** — 100 pools, each with a vLLM consumer Deployment, all
  Ready; then, over several resync passes with nothing changing, the operator's
  requests per pool per pass (writes must be zero), process CPU, and the
  process's memory growth for the 100 pools (operator and emulator share it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import Options, Report, Stat, Table, Target

NAMESPACE = "bench"
WRITE_METHODS = {"POST", "PUT", "PATCH", "DELETE"}
OPERATOR_AGENTS = ("kopf/", "kvpool-operator/")
POOLS_STEADY = 100
SMOKE_POOLS = 3
RESYNC = 20.0  # seconds between resync passes over one pool (production default: 30)
SMOKE_RESYNC = 2.0
PASSES = 2


def _api_server_class() -> type:
    import itertools

    import kmock

    from kvpool.operator.patching import apply as apply_patch

    sequence = itertools.count(1000)

    class ApiServer(kmock.KubernetesEmulator):
        """kmock's emulator plus the metadata a real API server stamps on writes.

        kmock keeps every request and matches each new one against that whole
        history (quadratic: hundreds of pools time out); this keeps a compact
        log of its own (``log``) and only the current request in kmock's.
        """

        async def _handle(self, request: kmock.Request) -> Any:
            log = self.__dict__.setdefault("log", [])
            log.append(Logged.of(request))
            del self._requests[:-1]
            if request.resource is not None and isinstance(request.data, dict):
                self._stamp(request)
            return await super()._handle(request)

        def _stamp(self, request: kmock.Request) -> None:
            meta = request.data.setdefault("metadata", {})
            if request.action == kmock.action.CREATE:
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = f"{meta['generateName']}{next(sequence)}"
                meta.setdefault("uid", f"uid-{next(sequence)}")
                meta["resourceVersion"] = str(next(sequence))
                meta.setdefault("generation", 1)
                meta.setdefault("creationTimestamp", "2025-01-01T00:00:00Z")
            elif request.action == kmock.action.UPDATE and request.name:
                key = (request.resource, request.namespace, request.name)
                if key not in self.objects or self.objects[key].deleted:
                    return
                current = self.objects[key].raw
                meta["resourceVersion"] = str(next(sequence))
                if request.subresource is None:
                    after = apply_patch(current, request.data)
                    if after.get("spec") != current.get("spec"):
                        meta["generation"] = current.get("metadata", {}).get("generation", 1) + 1

    return ApiServer


@dataclass(frozen=True)
class Logged:
    """What the benchmark keeps of one request."""

    method: str
    plural: str
    name: str | None
    watch: bool
    operator: bool

    @classmethod
    def of(cls, request: Any) -> Logged:
        import kmock

        agent = next((v for k, v in request.headers.items() if k.lower() == "user-agent"), "")
        return cls(
            method=request.method.upper(),
            plural=request.resource.plural if request.resource is not None else request.url.path,
            name=request.name,
            watch=request.action == kmock.action.WATCH,
            operator=agent.startswith(OPERATOR_AGENTS),
        )


def _pool_manifest(name: str, consumer: str | None) -> dict[str, Any]:
    from kvpool.operator.resources import POOLS

    spec: dict[str, Any] = {
        "image": "registry.example/mooncake:0.3.13",
        "store": {"segmentSize": "1GB", "replicas": 2},
        "connector": {"cache_prefix": name},
        "consumers": [],
    }
    if consumer is not None:
        spec["consumers"] = [
            {
                "name": consumer,
                "container": "vllm",
                "layout": {
                    "model": "org/model",
                    "groups": [
                        {"kind": "full", "block_size": 16},
                        {"kind": "sliding_window", "block_size": 16, "sliding_window": 4096},
                    ],
                },
            }
        ]
    return {
        "apiVersion": f"{POOLS.group}/{POOLS.version}",
        "kind": POOLS.kind,
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }


def _vllm_deployment(name: str) -> dict[str, Any]:
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
                            "args": ["--model", "org/model"],
                        }
                    ]
                },
            },
        },
    }


class Cluster:
    """The emulator and what the benchmark asks of it."""

    def __init__(self, api: Any):
        self.api = api

    @property
    def url(self) -> str:
        return str(self.api.url).rstrip("/")

    @property
    def log(self) -> list[Logged]:
        return self.api.__dict__.setdefault("log", [])

    def mark(self) -> int:
        return len(self.log)

    def operator_requests(self, start: int = 0) -> list[Logged]:
        return [r for r in self.log[start:] if r.operator]

    def get(self, path: str, name: str) -> dict[str, Any] | None:
        import kmock

        key = (kmock.resource(path), NAMESPACE, name)
        if key not in self.api.objects:
            return None
        obj = self.api.objects[key]
        return None if obj.deleted else obj.raw

    async def create(self, obj: dict[str, Any]) -> None:
        from kvpool.operator.resources import POOLS

        api_version = obj["apiVersion"]
        root = f"/apis/{api_version}" if "/" in api_version else f"/api/{api_version}"
        plural = {"Deployment": "deployments", "MooncakeKVPool": POOLS.plural}[obj["kind"]]
        response = await self.api.post(f"{root}/namespaces/{NAMESPACE}/{plural}", json=obj)
        if response.status not in (200, 201):
            raise RuntimeError(await response.text())

    def settle(self) -> None:
        """Play the Deployment controller: every Deployment's generation is rolled out."""
        for (resource, _, _), obj in list(self.api.objects.items()):
            if resource.plural != "deployments" or obj.deleted:
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

    def children_present(self, name: str) -> bool:
        from kvpool.operator.plan import build_plan

        pool = self.get(self.pools_path, name)
        if pool is None:
            return False
        plan = build_plan(name, NAMESPACE, pool["spec"])
        for child in plan.children:
            group_version = child["apiVersion"]
            plural = {
                "ConfigMap": "configmaps",
                "Deployment": "deployments",
                "Service": "services",
                "NetworkPolicy": "networkpolicies",
            }[child["kind"]]
            if self.get(f"{group_version}/{plural}", child["metadata"]["name"]) is None:
                return False
        return True

    @property
    def pools_path(self) -> str:
        from kvpool.operator.resources import POOLS

        return f"{POOLS.group}/{POOLS.version}/{POOLS.plural}"

    def ready(self, name: str) -> bool:
        """Ready, and kopf is done with the pool's current spec."""
        from kvpool.operator.resources import POOLS

        pool = self.get(self.pools_path, name) or {}
        if (pool.get("status") or {}).get("phase") != "Ready":
            return False
        annotations = pool.get("metadata", {}).get("annotations") or {}
        last = json.loads(annotations.get(f"{POOLS.group}/last-handled-configuration", "{}"))
        in_progress = [
            k
            for k in annotations
            if k.startswith(f"{POOLS.group}/")
            and k not in (f"{POOLS.group}/kopf-managed", f"{POOLS.group}/last-handled-configuration")
        ]
        return not in_progress and last.get("spec") == pool.get("spec")


async def _until(check: Any, timeout: float, what: str, interval: float = 0.005) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise TimeoutError(f"not reached in {timeout} s: {what}")
        await asyncio.sleep(interval)


class OperatorThread:
    """The operator in its own thread and event loop, stopped through kopf's stop flag."""

    def __init__(self, config: Any):
        self.config = config
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="kvpool-operator", daemon=True)

    def _main(self) -> None:
        from kvpool.operator.runner import run

        try:
            asyncio.run(run(self.config, stop_flag=self.stop_flag, ready_flag=self.ready_flag))
        except BaseException as exc:
            self.error = exc

    def start(self) -> None:
        self._thread.start()

    async def stop(self, timeout: float = 60.0) -> None:
        self.stop_flag.set()
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            raise RuntimeError("the operator did not stop")


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def _register_crd(api: Any) -> None:
    import kmock

    from kvpool.operator.crd import build_crd
    from kvpool.operator.resources import POOLS

    api.resources.load_bundled()
    version = build_crd()["spec"]["versions"][0]
    api.resources[f"{POOLS.group}/{POOLS.version}/{POOLS.plural}"] = kmock.ResourceInfo(
        kind=POOLS.kind,
        singular="mooncakekvpool",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"},
        shortnames={"mkvp"},
        subresources=set(version["subresources"]),
    )


async def _bench(reps: int, pools: int, resync: float) -> dict[str, Any]:
    import kmock

    from kvpool.operator.config import OperatorConfig

    logging.getLogger("kopf").setLevel(logging.WARNING)
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    api_class = _api_server_class()
    async with api_class() as api, kmock.Server(api, host="127.0.0.1"):
        await _register_crd(api)
        cluster = Cluster(api)
        with tempfile.TemporaryDirectory(prefix="kvpool-bench-op-") as tmp:
            kubeconfig = Path(tmp) / "kubeconfig"
            kubeconfig.write_text(
                json.dumps(
                    {
                        "apiVersion": "v1",
                        "kind": "Config",
                        "current-context": "kmock",
                        "clusters": [{"name": "kmock", "cluster": {"server": cluster.url}}],
                        "users": [{"name": "operator", "user": {"token": "bench"}}],
                        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "operator"}}],
                    }
                )
            )
            operator = OperatorThread(
                OperatorConfig(
                    namespaces=(NAMESPACE,),
                    kubeconfig=str(kubeconfig),
                    liveness_endpoint=None,
                    metrics_port=None,
                    resync_interval=resync,
                    retry_delay=0.5,
                    request_timeout=10.0,
                    exit_timeout=None,
                    log_level=logging.WARNING,
                )
            )
            operator.start()
            try:
                await _until(
                    lambda: operator.ready_flag.is_set() or operator.error is not None,
                    60,
                    "the operator starts",
                )
                await _until(
                    lambda: any(r.watch for r in cluster.operator_requests()) or operator.error is not None,
                    60,
                    "the operator watches",
                )
                if operator.error is not None:
                    raise RuntimeError(f"the operator died: {operator.error!r}")
                return await _measure(cluster, reps, pools, resync)
            finally:
                await operator.stop()
                if operator.error is not None:
                    raise RuntimeError(f"the operator failed: {operator.error!r}")


async def _measure(cluster: Cluster, reps: int, pools: int, resync: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    to_children = []
    for i in range(reps):
        name = f"first-{i}"
        started = loop.time()
        await cluster.create(_pool_manifest(name, None))
        await _until(lambda n=name: cluster.children_present(n), 60, f"{name}'s children")
        to_children.append(loop.time() - started)

    rss_before = _rss_bytes()
    started = loop.time()
    names = [f"pool-{i:03d}" for i in range(pools)]
    for i, name in enumerate(names):
        await cluster.create(_vllm_deployment(f"llm-{i:03d}"))
        await cluster.create(_pool_manifest(name, f"llm-{i:03d}"))

    def all_ready() -> bool:
        cluster.settle()
        return all(cluster.ready(n) for n in names)

    await _until(all_ready, 10 * resync + 120, f"{pools} pools Ready", interval=0.2)
    converge_s = loop.time() - started
    await asyncio.sleep(resync)  # let passes under way finish
    mark = cluster.mark()
    cpu, wall = time.process_time(), loop.time()
    await asyncio.sleep(PASSES * resync + 0.5)
    cpu, wall = time.process_time() - cpu, loop.time() - wall
    cluster.settle()
    requests = cluster.operator_requests(mark)
    rss_after = _rss_bytes()
    every_pool = {*names, *(f"first-{i}" for i in range(reps))}
    pool_gets = [
        r for r in requests if r.method == "GET" and r.plural == "mooncakekvpools" and r.name in every_pool
    ]
    passes = len(pool_gets) / len(every_pool)
    by_kind: dict[str, int] = {}
    for r in requests:
        key = f"{r.method} {r.plural}"
        by_kind[key] = by_kind.get(key, 0) + 1
    writes = [f"{r.method} {r.plural}/{r.name}" for r in requests if r.method in WRITE_METHODS]
    return {
        "to_children": to_children,
        "resync_seconds": resync,
        "pools": pools,
        "pools_in_window": len(every_pool),
        "converge_seconds": converge_s,
        "window_seconds": wall,
        "window_cpu_seconds": cpu,
        "passes_per_pool": passes,
        "requests": len(requests),
        "requests_by_kind": by_kind,
        "writes": writes,
        "rss_growth_bytes": rss_after - rss_before,
    }


def run(opts: Options) -> Report:
    reps = opts.repetitions(7)
    pools = SMOKE_POOLS if opts.smoke else POOLS_STEADY
    data = asyncio.run(_bench(reps, pools, SMOKE_RESYNC if opts.smoke else RESYNC))
    return _report(data, reps)


def _report(d: dict[str, Any], reps: int) -> Report:
    report = Report(
        "operator_reconcile", "6. Operator: time to children, 100 pools in steady state (kmock)", ""
    )
    first = Table(
        f"one new pool (no consumers), seconds: median (min..max) of {reps}", ["measure", "seconds"]
    )
    first.add("POST pool → every planned child exists", Stat.of(d["to_children"]).fmt(digits=3))
    report.tables.append(first)
    per_pass = d["requests"] / max(1.0, d["passes_per_pool"] * d["pools_in_window"])
    steady = Table(
        f"{d['pools']} pools, each with a vLLM consumer Deployment; resync every {d['resync_seconds']:g} s",
        ["measure", "value"],
    )
    steady.add("create all → all Ready", f"{d['converge_seconds']:.1f} s")
    steady.add(
        "steady-state window", f"{d['window_seconds']:.1f} s, {d['passes_per_pool']:.1f} passes per pool"
    )
    steady.add(f"operator requests in the window ({d['pools_in_window']} pools)", d["requests"])
    steady.add("requests per pool per pass", f"{per_pass:.2f}")
    steady.add("by kind", ", ".join(f"{k}: {v}" for k, v in sorted(d["requests_by_kind"].items())))
    steady.add("writes in the window", len(d["writes"]))
    steady.add(
        "process CPU in the window (operator + emulator)",
        f"{d['window_cpu_seconds']:.2f} s "
        f"({d['window_cpu_seconds'] / d['window_seconds'] * 100:.0f}% of one core)",
    )
    steady.add(
        f"process memory growth for {d['pools']} pools (operator + emulator)",
        f"{common.mib(d['rss_growth_bytes'])} ({d['rss_growth_bytes'] / d['pools'] / 1024:.0f} KiB per pool)",
    )
    report.tables.append(steady)
    report.targets.append(
        Target("no writes when nothing changed", f"{len(d['writes'])} writes", not d["writes"])
    )
    report.notes.append(
        "kmock stands in for kube-apiserver (none can run here); its latency and the operator's share "
        "one 2-core machine, so times are an upper bound on the operator's own work."
    )
    report.notes.append(
        "'create all → all Ready' includes waiting for the operator's next resync pass over each pool "
        "(it sees the stand-in controller's rollout on resync), so it tracks the resync interval."
    )
    report.data.update(d)
    return report


if __name__ == "__main__":
    sys.exit(common.main("benchmarks.operator_reconcile", __doc__, run))
