"""Operator: time from creating a MooncakeKVPool to its children, and 100 pools in steady state.

The real operator (kopf, its handlers, its Kubernetes client; ``kvpool.operator.app.run``)
runs in a thread against the tests' emulated cluster (``testing.kube_api``): kmock,
a stateful Kubernetes API emulator over HTTP on 127.0.0.1 (no kube-apiserver can be had
here), behaving like an API server where the operator depends on it (server-side
defaults, CRD pruning, the status subresource, 409s, generation) and a stand-in
Deployment controller that marks Deployments rolled out. Measured:

* **time to children** — from the pool's ``POST`` returning to every child the
  pure ``build_plan`` wants existing on the API server;
* **steady state** — 100 pools, each with a vLLM consumer Deployment, all
  Ready; then, over several resync passes with nothing changing, the operator's
  requests per pool per pass (writes must be zero), process CPU, and the
  process's memory growth for the 100 pools (operator and emulator share it).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import Options, Report, Stat, Table, Target

POOLS_STEADY = 100
SMOKE_POOLS = 3
RESYNC = 20.0  # seconds between resync passes over one pool (production default: 30)
SMOKE_RESYNC = 2.0
PASSES = 2
FAST_POLL = 0.005  # seconds: how closely "every child exists" is watched


def _pool_manifest(name: str, consumer_name: str | None) -> dict[str, Any]:
    """A pool with one hybrid-model consumer (or none), as the operator tests declare it."""
    from testing.operator_objects import consumer, pool_manifest, pool_spec

    consumers = [consumer(consumer_name)] if consumer_name is not None else []
    return pool_manifest(name, pool_spec(connector={"cache_prefix": name}, consumers=consumers))


def _children_present(cluster: Any, name: str) -> bool:
    """Every child the pure ``build_plan`` wants for pool ``name`` exists on the API server."""
    from kvpool.operator.names import api_resource_of
    from kvpool.operator.plan import build_plan
    from testing.kube_api import NAMESPACE, POOLS_PATH

    pool = cluster.get(POOLS_PATH, name)
    if pool is None:
        return False
    for child in build_plan(name, NAMESPACE, pool["spec"]).children:
        resource = api_resource_of(child)
        if cluster.get(f"{resource.api_version}/{resource.plural}", child["metadata"]["name"]) is None:
            return False
    return True


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def _bench(reps: int, pools: int, resync: float) -> dict[str, Any]:
    import kmock

    from kvpool.operator.app import OperatorOptions
    from testing.kube_api import (
        NAMESPACE,
        Cluster,
        LeanApiServer,
        OperatorThread,
        declare_resources,
        eventually,
        write_kubeconfig,
    )

    logging.getLogger("kopf").setLevel(logging.WARNING)
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    async with LeanApiServer() as api, kmock.Server(api, host="127.0.0.1"):
        declare_resources(api)
        cluster = Cluster(api)
        with tempfile.TemporaryDirectory(prefix="kvpool-bench-op-") as tmp:
            operator = OperatorThread(
                OperatorOptions(
                    namespaces=(NAMESPACE,),
                    kubeconfig=str(write_kubeconfig(Path(tmp) / "kubeconfig", cluster.url)),
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
                await eventually(
                    lambda: operator.ready_flag.is_set() or operator.error is not None,
                    what="the operator starts",
                    interval=FAST_POLL,
                )
                await eventually(
                    lambda: any(r.watch and r.operator for r in api.log) or operator.error is not None,
                    what="the operator watches",
                    interval=FAST_POLL,
                )
                if operator.error is not None:
                    raise RuntimeError(f"the operator died: {operator.error!r}")
                return await _measure(cluster, api, reps, pools, resync)
            finally:
                await operator.stop()
                if operator.error is not None:
                    raise RuntimeError(f"the operator failed: {operator.error!r}")


async def _measure(cluster: Any, api: Any, reps: int, pools: int, resync: float) -> dict[str, Any]:
    from kvpool.operator.names import POOLS
    from testing.kube_api import WRITE_METHODS, eventually
    from testing.operator_objects import vllm_deployment

    loop = asyncio.get_running_loop()
    to_children = []
    for i in range(reps):
        name = f"first-{i}"
        started = loop.time()
        await cluster.create(_pool_manifest(name, None))
        await eventually(
            lambda n=name: _children_present(cluster, n), what=f"{name}'s children", interval=FAST_POLL
        )
        to_children.append(loop.time() - started)

    rss_before = _rss_bytes()
    started = loop.time()
    names = [f"pool-{i:03d}" for i in range(pools)]
    for i, name in enumerate(names):
        await cluster.create(vllm_deployment(f"llm-{i:03d}", allow_pool=name))
        await cluster.create(_pool_manifest(name, f"llm-{i:03d}"))

    def all_ready() -> bool:
        cluster.settle()
        return all(cluster.pool_status(n).get("phase") == "Ready" and cluster.handled(n) for n in names)

    await eventually(all_ready, timeout=10 * resync + 120, what=f"{pools} pools Ready", interval=0.2)
    converge_s = loop.time() - started
    await asyncio.sleep(resync)  # let passes under way finish
    mark = len(api.log)
    cpu, wall = time.process_time(), loop.time()
    await asyncio.sleep(PASSES * resync + 0.5)
    cpu, wall = time.process_time() - cpu, loop.time() - wall
    cluster.settle()
    requests = [r for r in api.log[mark:] if r.operator]
    rss_after = _rss_bytes()
    every_pool = {*names, *(f"first-{i}" for i in range(reps))}
    pool_gets = [
        r for r in requests if r.method == "GET" and r.plural == POOLS.plural and r.name in every_pool
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
