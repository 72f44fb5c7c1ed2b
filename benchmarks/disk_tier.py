"""9. Disk tier: a working set three times the store's memory, with and without a local disk tier.

Each repetition starts a fresh local pool (a master and one store) for each variant, writes
the working set through the connector's pool client (reserve, write, publish; a write the
pool refuses for lack of memory is tried again until the tier has made room), then loads
every object back in the order written and checks its bytes. The oldest third can only
hit from the disk tier; the newest third is in memory either way.

``python -m benchmarks.disk_tier [--smoke] [--reps N] [--write]``
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks import pool as bench_pool
from benchmarks.common import Options, Report, Stat, Table, Target
from testing.disk_workload import WorkloadResult, write_and_read

SEGMENT_MB, OBJECT_KB = 64, 1024
SMOKE_SEGMENT_MB, SMOKE_OBJECT_KB = 16, 512
VARIANTS = ("memory only", "memory + disk tier")
HIT_RATE_GOAL = 0.99


def _pass(variant: str, segment_mb: int, object_bytes: int, workdir: Path) -> tuple[WorkloadResult, float]:
    """One working set on a fresh pool; its result and the seconds its writes took."""
    from kvpool.connector.local.disk_tier import DiskTier
    from kvpool.connector.local.pool import LocalPool

    tier = None
    if variant == VARIANTS[1]:
        tier = DiskTier(
            capacity=8 * segment_mb << 20, parent=workdir, bucket_bytes=min(8, segment_mb // 4) << 20
        )
    objects = 3 * (segment_mb << 20) // object_bytes
    with LocalPool(segment_size=f"{segment_mb}MB", disk_tier=tier) as lp:
        client = bench_pool.client(lp.address, "disk-tier")
        try:
            started = time.perf_counter()
            result = write_and_read(client, [f"ws-{i}" for i in range(objects)], object_bytes)
            seconds = time.perf_counter() - started
        finally:
            client.close()
    return result, seconds


def _thirds(result: WorkloadResult) -> tuple[list[float], list[float]]:
    """Load seconds of the hits among the oldest third and among the newest third."""
    third = result.objects // 3
    hit_indices = [i for i in range(result.objects) if i not in set(result.missed)]
    seconds = dict(zip(hit_indices, result.hit_seconds, strict=True))
    oldest = [s for i, s in seconds.items() if i < third]
    newest = [s for i, s in seconds.items() if i >= result.objects - third]
    return oldest, newest


def run(opts: Options) -> Report:
    reps = opts.repetitions(3)
    segment_mb, object_kb = (SMOKE_SEGMENT_MB, SMOKE_OBJECT_KB) if opts.smoke else (SEGMENT_MB, OBJECT_KB)
    results: dict[str, list[tuple[WorkloadResult, float]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-disk-") as workdir:
        for rep in range(reps):
            for variant in common.rotate(VARIANTS, rep):
                results[variant].append(_pass(variant, segment_mb, object_kb << 10, Path(workdir)))
            print(f"  repetition {rep + 1}/{reps}: done", file=sys.stderr, flush=True)
    return _report(results, reps, segment_mb, object_kb)


def _ms(values: list[float]) -> str:
    return Stat.of(values).fmt(1000, 3) if values else "-"


def _report(
    results: dict[str, list[tuple[WorkloadResult, float]]], reps: int, segment_mb: int, object_kb: int
) -> Report:
    objects = results[VARIANTS[0]][0][0].objects
    report = Report("disk_tier", "9. Disk tier: hits of a working set three times the store's memory", "")
    table = Table(
        f"{objects} objects of {object_kb} KiB ({objects * object_kb >> 10} MiB) on a store of "
        f"{segment_mb} MiB, {reps} repetition(s); load ms of one object, median (min..max) over all "
        "loads of the repetitions",
        [
            "variant",
            "hit rate",
            "wrong bytes",
            "load ms, all hits",
            "load ms, oldest third",
            "load ms, newest third",
            "writes refused then retried",
            "write+read s",
        ],
    )
    rates: dict[str, Stat] = {}
    data: dict[str, Any] = {}
    for variant in VARIANTS:
        runs = results[variant]
        rates[variant] = Stat.of([r.hit_rate for r, _ in runs])
        oldest = [s for r, _ in runs for s in _thirds(r)[0]]
        newest = [s for r, _ in runs for s in _thirds(r)[1]]
        every = [s for r, _ in runs for s in r.hit_seconds]
        table.add(
            variant,
            rates[variant].fmt(1, 3),
            sum(r.wrong for r, _ in runs),
            _ms(every),
            _ms(oldest),
            _ms(newest),
            statistics.median([r.refusals for r, _ in runs]),
            Stat.of([s for _, s in runs]).fmt(1, 1),
        )
        data[variant] = [
            {
                "hit_rate": r.hit_rate,
                "hits": r.hits,
                "wrong": r.wrong,
                "misses": r.misses,
                "refusals": r.refusals,
                "not_stored": r.not_stored,
                "seconds": s,
                "load_seconds_median": statistics.median(r.hit_seconds) if r.hit_seconds else None,
            }
            for r, s in runs
        ]
    report.tables.append(table)
    tiered = rates[VARIANTS[1]]
    report.targets.append(
        Target(
            "with the disk tier, a working set 3x the store's memory keeps its hits "
            f"(hit rate >= {HIT_RATE_GOAL})",
            f"hit rate {tiered.fmt(1, 3)}",
            tiered.low >= HIT_RATE_GOAL,
        )
    )
    wrong = sum(r.wrong for runs in results.values() for r, _ in runs)
    report.targets.append(Target("no load returns another object's bytes", f"{wrong} wrong", wrong == 0))
    report.notes += [
        "Memory only: the master evicts the oldest objects as memory fills; about a third of the "
        "working set (what memory holds) still hits.",
        "With the tier (kvpool.connector.local.disk_tier: Mooncake's SSD offload, bucket backend, one "
        "object a bucket, a 1 s offload heartbeat, a 1 s read lease): the store writes every object to its "
        "directory; objects whose memory copy was evicted are read from the file by the store's offload RPC "
        "server. Writes faster than the tier drains are refused (store_full) until it has written what fills "
        "the memory: the retries column.",
    ]
    report.data["runs"] = data
    report.data["segment_mb"] = segment_mb
    report.data["object_kb"] = object_kb
    return report


if __name__ == "__main__":
    sys.exit(common.main("benchmarks.disk_tier", __doc__, run))
