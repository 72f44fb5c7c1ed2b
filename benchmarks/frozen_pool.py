"""Frozen pool: how long a lookup and the connector's part of an engine step wait on a frozen master or store.

One master and one store process on loopback, frozen with SIGSTOP and thawed
with SIGCONT. Side by side, on the same client:

* **connector** — the scheduler's existence check (a question to its presence
  service, ``PresenceService.ask``, bounded by ``lookup_timeout_s``) and the
  worker's part of one engine step, exactly what vLLM calls: the save barrier
  (``before_forward``), a synchronous load of 16 blocks (``start_loads``, bounded
  by ``load_timeout_s``) and the save of 16 fresh blocks (``start_saves``);
* **raw** — the same Mooncake calls with nothing around them (``batch_is_exist``;
  ``batch_get_into_multi_buffers`` and ``batch_put_from_multi_buffers`` on the
  same blocks): what a connector without deadlines waits, until Mooncake's own
  timeout (``store_timeout_s``, the RPC and TCP no-progress timeouts).

Each frozen episode runs several consecutive steps: the first waits out the
deadline, the next ones fail at once while the call given up on is still stuck.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from benchmarks import common
from benchmarks.common import Options, Report, Stat, Table, Target, stopwatch
from testing.pool_store import raw_store
from testing.worker import run_loads

BLOCKS = 16
LAYERS = 6
SHAPE_TAIL = (32, 4, 128)  # tokens per block, KV heads, head size (bf16)
LOOKUP_S, DEADLINE_S = 0.5, 1.0
STORE_TIMEOUT_S, SMOKE_STORE_TIMEOUT_S = 10, 2
STEPS, SMOKE_STEPS = 4, 2
#: The smoke thaws a raw episode's process after this long: a raw call on a frozen store
#: otherwise waits out Mooncake's 60 s transfer timeout, most of the smoke's time.
SMOKE_RAW_FREEZE_S = 4.0
SLACK = 1.5  # a bounded wait: at most this times its deadline
PHASES = ("healthy", "master frozen", "store frozen")


@dataclass
class Rig:
    worker: Any
    sched: Any
    client: Any
    caches: dict[str, Any]
    lookup_keys: list[str]
    load_digests: list[str]

    @property
    def store(self) -> Any:
        return raw_store(self.client)

    def keys(self, digests: list[str]) -> list[str]:
        return [self.worker.keyspace.key(0, 0, 0, d) for d in digests]

    def scatter(self, block_ids: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        lists = [self.worker.memory_runs(0, b) for b in block_ids]
        return [p for p, _ in lists], [s for _, s in lists]


def _make_rig(address: str, store_timeout_s: int) -> Rig:
    import torch

    from benchmarks import pool
    from kvpool.connector.contract.keys import KeySpace
    from kvpool.connector.observability.records import StatsCollector
    from kvpool.connector.scheduler.side import SchedulerSide
    from kvpool.connector.worker.side import Deadlines, WorkerSide

    client = pool.client(address, "frozen", store_timeout_s=store_timeout_s)
    num_blocks = 3 * BLOCKS + 1
    gen = torch.Generator().manual_seed(0)
    caches = {
        f"l{i}": torch.randn((2, num_blocks, *SHAPE_TAIL), generator=gen).to(torch.bfloat16)
        for i in range(LAYERS)
    }
    keyspace = KeySpace("frozen", "bench")
    worker = WorkerSide(
        client=client,
        keyspace=keyspace,
        tp_rank=0,
        pp_rank=0,
        group_layers=[list(caches)],
        num_blocks=num_blocks,
        stats=StatsCollector(group_kinds=("full",)),
        deadlines=Deadlines(load_s=DEADLINE_S, save_s=DEADLINE_S, shutdown_s=DEADLINE_S),
    )
    worker.register_kv_caches(caches)
    sched = SchedulerSide(
        client=client,
        keyspace=keyspace,
        tp_size=1,
        pp_size=1,
        can_load=True,
        can_save=True,
        stats=StatsCollector(),
        lookup_timeout_s=LOOKUP_S,
    )
    digests = [f"load-{i}" for i in range(BLOCKS)]
    rig = Rig(worker, sched, client, caches, [], digests)
    rig.lookup_keys = rig.keys(digests)
    return rig


def _seed(rig: Rig) -> None:
    """Store the blocks every load reads (again: a long freeze may have cost the pool its segment)."""
    from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestSave

    rig.client.remove(rig.lookup_keys)
    save = RequestSave("seed", [GroupTransfer(0, list(rig.load_digests), list(range(1, BLOCKS + 1)))])
    rig.worker.start_saves(PoolConnectorMetadata(saves=[save]))
    rig.worker.before_forward()
    rig.worker.wait_for_saves()
    present = rig.client.exists(rig.lookup_keys)
    if not all(present):
        raise RuntimeError(f"seeding stored {sum(present)} of {BLOCKS} blocks")


def _connector_step(rig: Rig, step: int) -> None:
    from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestLoad, RequestSave

    worker = rig.worker
    worker.before_forward()
    dst = list(range(BLOCKS + 1, 2 * BLOCKS + 1))
    load = RequestLoad(f"l{step}", [GroupTransfer(0, list(rig.load_digests), dst)], BLOCKS * 32)
    run_loads(worker, [load])
    worker.take_load_errors()
    fresh = [f"save-{time.monotonic_ns()}-{i}" for i in range(BLOCKS)]
    src = list(range(2 * BLOCKS + 1, 3 * BLOCKS + 1))
    worker.start_saves(PoolConnectorMetadata(saves=[RequestSave(f"s{step}", [GroupTransfer(0, fresh, src)])]))


def _raw_step(rig: Rig, step: int) -> None:
    load_ptrs, load_sizes = rig.scatter(list(range(BLOCKS + 1, 2 * BLOCKS + 1)))
    rig.store.batch_get_into_multi_buffers(rig.lookup_keys, load_ptrs, load_sizes)
    save_ptrs, save_sizes = rig.scatter(list(range(2 * BLOCKS + 1, 3 * BLOCKS + 1)))
    fresh = [f"rawsave-{time.monotonic_ns()}-{i}" for i in range(BLOCKS)]
    rig.store.batch_put_from_multi_buffers(fresh, save_ptrs, save_sizes)


def _settle(rig: Rig, timeout: float) -> None:
    """Until no call given up on is still in flight and the blocks every load reads are stored."""
    deadline = time.monotonic() + timeout
    while rig.worker.jobs.live():
        if time.monotonic() > deadline:
            raise RuntimeError("a call given up on never returned")
        time.sleep(0.05)
    while True:
        try:
            _seed(rig)
            return
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)  # the store remounting its segment after a long freeze


def _episode(
    rig: Rig, process: Any, steps: int, variant: str, thaw_after_s: float | None = None
) -> dict[str, list[float]]:
    """Freeze ``process`` (or nothing), then time lookups and steps of one variant; thaw (at the
    latest ``thaw_after_s`` after freezing, when given)."""
    out: dict[str, list[float]] = {"lookup": [], "step": []}
    thaw: threading.Timer | None = None
    if process is not None:
        os.kill(process.pid, signal.SIGSTOP)
        if thaw_after_s is not None:
            thaw = threading.Timer(thaw_after_s, os.kill, (process.pid, signal.SIGCONT))
            thaw.start()
    try:
        for step in range(steps if variant == "connector" else 1):
            with stopwatch() as t:
                if variant == "connector":
                    rig.sched.presence.ask(lambda: rig.lookup_keys).result()
                else:
                    rig.store.batch_is_exist(rig.lookup_keys)
            out["lookup"].append(t[0])
            with stopwatch() as t:
                (_connector_step if variant == "connector" else _raw_step)(rig, step)
            out["step"].append(t[0])
    finally:
        if thaw is not None:
            thaw.cancel()
        if process is not None:
            os.kill(process.pid, signal.SIGCONT)
    return out


def run(opts: Options) -> Report:
    from kvpool.connector.local.pool import LocalPool

    reps = opts.repetitions(2)
    steps = SMOKE_STEPS if opts.smoke else STEPS
    store_timeout = SMOKE_STORE_TIMEOUT_S if opts.smoke else STORE_TIMEOUT_S
    seconds: dict[str, dict[str, dict[str, list[float]]]] = {
        phase: {op: {"connector": [], "raw": []} for op in ("lookup", "step")} for phase in PHASES
    }
    with LocalPool(segment_size="256MB") as lp:
        rig = _make_rig(lp.address, store_timeout)
        try:
            _seed(rig)
            for rep in range(reps):
                for phase in PHASES:
                    target = {"healthy": None, "master frozen": lp.master, "store frozen": lp.store}[phase]
                    process = None if target is None else target.process
                    for variant in common.rotate(("connector", "raw"), rep):
                        thaw_after = SMOKE_RAW_FREEZE_S if opts.smoke and variant == "raw" else None
                        timings = _episode(rig, process, steps, variant, thaw_after)
                        for op, values in timings.items():
                            seconds[phase][op][variant].extend(values)
                        _settle(rig, 6 * store_timeout + 30)
                print(f"  repetition {rep + 1}/{reps}: done", file=sys.stderr, flush=True)
        finally:
            rig.sched.close()
            rig.worker.shutdown()
            rig.client.close()
    return _report(seconds, reps, steps, store_timeout, opts)


def _report(
    seconds: dict[str, dict[str, dict[str, list[float]]]],
    reps: int,
    steps: int,
    store_timeout: int,
    opts: Options,
) -> Report:
    title = "8. Frozen pool: lookup and step latency under a frozen master or store"
    report = Report("frozen_pool", title, "")
    table = Table(
        f"seconds, median (min..max); connector: {steps} consecutive steps per episode, raw: the first "
        f"call; {reps} episode(s) per phase; deadlines: lookup {LOOKUP_S} s, load and save {DEADLINE_S} s; "
        f"Mooncake's own timeouts {store_timeout} s",
        ["phase", "operation", "connector s", "connector worst s", "raw s", "raw median / connector worst"],
    )
    worst: dict[tuple[str, str], float] = {}
    for phase in PHASES:
        for op in ("lookup", "step"):
            con, raw = Stat.of(seconds[phase][op]["connector"]), Stat.of(seconds[phase][op]["raw"])
            worst[(phase, op)] = con.high
            table.add(
                phase,
                op,
                con.fmt(digits=3),
                f"{con.high:.3f}",
                raw.fmt(digits=3),
                f"{raw.median / con.high:.1f}x" if con.high > 0 else "-",
            )
    report.tables.append(table)
    if opts.smoke:
        report.notes.append(
            f"Smoke: a raw episode's process is thawed after {SMOKE_RAW_FREEZE_S:.0f} s, so its raw "
            "calls wait out the freeze, not Mooncake's own timeout."
        )
    for phase in ("master frozen", "store frozen"):
        for op, deadline in (("lookup", LOOKUP_S), ("step", DEADLINE_S)):
            limit = SLACK * deadline
            report.targets.append(
                Target(
                    f"{op}, {phase}: bounded by its deadline (worst ≤ {limit:.2f} s)",
                    f"worst {worst[(phase, op)]:.3f} s",
                    worst[(phase, op)] <= limit,
                )
            )
    report.notes.append(
        "The connector's first step of an episode waits out one deadline; while the call it gave up "
        "on is still stuck inside Mooncake, the next steps' loads and saves fail at once (recomputed "
        "and skipped), and lookups miss at once. The raw calls wait for Mooncake's own timeout."
    )
    report.data["seconds"] = seconds
    report.data["deadlines"] = {"lookup_s": LOOKUP_S, "load_s": DEADLINE_S, "save_s": DEADLINE_S}
    report.data["store_timeout_s"] = store_timeout
    return report


if __name__ == "__main__":
    sys.exit(common.main("benchmarks.frozen_pool", __doc__, run))
