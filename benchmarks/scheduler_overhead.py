"""Scheduler overhead: vLLM scheduler step time with KVPoolConnector (no hits) vs without a connector.

Two real vLLM ``Scheduler`` objects, identical but for the connector (full
attention + a sliding window; the pool is empty, so every lookup misses and
every computed block is planned for saving). Each repetition adds N waiting
requests (fresh 128-token prompts) to each, then times the step that admits
them all (``schedule`` + ``update_from_output`` with one sampled token each)
and the decode steps after it. Requests are then aborted (untimed).
"""

from __future__ import annotations

import gc
import random
import sys
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import Options, Report, Stat, Table, Target, ratios, rotate, stopwatch
from benchmarks.vllm_env import bench_scheduler, ours_transfer, tiny_long_model
from tests.support.kv_cache import GroupDesc
from tests.support.scheduler import make_request

WAITING = (64, 256)
SMOKE_WAITING = (8,)
PROMPT = 128
DECODE_STEPS = 8
GROUPS = [GroupDesc("full"), GroupDesc("sliding_window", window=128)]
VARIANTS = ("with", "without")


def _step(scheduler: Any) -> tuple[Any, float]:
    """One engine step minus the model: schedule, then one sampled token per scheduled request."""
    from vllm.v1.outputs import ModelRunnerOutput

    with stopwatch() as t:
        output = scheduler.schedule()
        req_ids = list(output.num_scheduled_tokens)
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[7] for _ in req_ids],
        )
        scheduler.update_from_output(output, runner)
    return output, t[0]


def _cycle(scheduler: Any, prompts: list[list[int]]) -> tuple[float, float, int]:
    """Admit ``prompts`` and decode; (admission step s, median decode step s, requests admitted)."""
    from vllm.v1.request import RequestStatus

    requests = [make_request(scheduler, p, max_tokens=DECODE_STEPS + 4) for p in prompts]
    for r in requests:
        scheduler.add_request(r)
    output, admit = _step(scheduler)
    admitted = len(output.num_scheduled_tokens)
    decode = [_step(scheduler)[1] for _ in range(DECODE_STEPS)]
    scheduler.finish_requests([r.request_id for r in requests], RequestStatus.FINISHED_ABORTED)
    _step(scheduler)  # hands the finished ids to the connector, as the next real step would
    return admit, Stat.of(decode).median, admitted


def run(opts: Options) -> Report:
    from vllm.utils.gc_utils import freeze_gc_heap

    from kvpool.connector.local.pool import LocalPool
    from kvpool.connector.local.recording import Recording

    reps = opts.repetitions(9)
    sizes = SMOKE_WAITING if opts.smoke else WAITING
    model = tiny_long_model()
    rng = random.Random(5)
    rows = []
    with LocalPool(segment_size="256MB") as lp:
        kwargs = {
            "num_blocks": 4096,
            "max_model_len": 1024,
            "max_num_seqs": max(sizes),
            "max_num_batched_tokens": max(sizes) * PROMPT,
        }
        schedulers = {
            "with": bench_scheduler(model, GROUPS, ours_transfer(lp.address, "sched"), **kwargs),
            "without": bench_scheduler(model, GROUPS, None, **kwargs),
        }
        recording = Recording()  # the lookups' own timings
        recording.tap(schedulers["with"].connector.stats)
        try:
            for n in sizes:
                for v in VARIANTS:  # warm-up
                    _cycle(schedulers[v], [[rng.randrange(3, 500) for _ in range(PROMPT)] for _ in range(n)])
                freeze_gc_heap()  # as vLLM's EngineCore does after start-up
                seen = len(recording.lookups)
                admit: dict[str, list[float]] = {v: [] for v in VARIANTS}
                decode: dict[str, list[float]] = {v: [] for v in VARIANTS}
                for rep in range(reps):
                    for v in rotate(VARIANTS, rep):
                        prompts = [[rng.randrange(3, 500) for _ in range(PROMPT)] for _ in range(n)]
                        a, d, admitted = _cycle(schedulers[v], prompts)
                        if admitted != n:
                            raise RuntimeError(f"{v}: admitted {admitted} of {n} waiting requests")
                        admit[v].append(a)
                        decode[v].append(d)
                lookups = [rec.seconds for rec in recording.lookups[seen:]]
                rows.append({"waiting": n, "admit": admit, "decode": decode, "lookup_seconds": lookups})
                print(f"  {n} waiting: done", file=sys.stderr, flush=True)
        finally:
            gc.unfreeze()
            for s in schedulers.values():
                s.shutdown()
    return _report(rows, reps, opts)


def _report(rows: list[dict[str, Any]], reps: int, opts: Options) -> Report:
    report = Report("scheduler_overhead", "5. Scheduler step: with KVPoolConnector (no hits) vs without", "")
    table = Table(
        f"step time ms, median (min..max) of {reps}; ratio = with / without, paired per repetition",
        ["waiting", "step", "with connector ms", "without ms", "ratio", "per request µs (with - without)"],
    )
    worst = 0.0
    for r in rows:
        for step, key in (
            ("admission (all prefill)", "admit"),
            (f"decode (median of {DECODE_STEPS})", "decode"),
        ):
            w, wo = Stat.of(r[key]["with"]), Stat.of(r[key]["without"])
            ratio = ratios(r[key]["with"], r[key]["without"])
            r[f"{key}_ratio"] = ratio.median
            if key == "admit":
                worst = max(worst, ratio.median)
            table.add(
                r["waiting"],
                step,
                w.fmt(1e3),
                wo.fmt(1e3),
                ratio.ratio(),
                f"{(w.median - wo.median) / r['waiting'] * 1e6:.0f}",
            )
    report.tables.append(table)
    own = Table(
        "the connector's own lookup records during the timed admission steps (one per request)",
        ["waiting", "lookups", "lookup ms per request", "lookups' share of the admission step's extra time"],
    )
    for r in rows:
        if not r["lookup_seconds"]:
            continue
        st = Stat.of(r["lookup_seconds"])
        extra = Stat.of(r["admit"]["with"]).median - Stat.of(r["admit"]["without"]).median
        share = st.median * r["waiting"] / extra * 100 if extra > 0 else float("nan")
        own.add(r["waiting"], len(r["lookup_seconds"]), st.fmt(1e3, 3), f"{share:.0f}%")
    report.tables.append(own)
    report.targets.append(
        Target("admission step ≤ 1.1x without connector", f"worst median {worst:.2f}x", worst <= 1.1)
    )
    decode_worst = max(r["decode_ratio"] for r in rows)
    report.targets.append(
        Target("(decode step, not a stated target)", f"worst median {decode_worst:.2f}x", None)
    )
    report.notes.append(
        "Admission includes one batch_is_exist round trip per request to the Mooncake master on loopback "
        "and the save plan of every request's blocks; decode steps include the per-step save planning."
    )
    report.data["rows"] = rows
    path = common.plot_path("scheduler_overhead", opts)
    if path is not None and _plot(rows, path):
        report.plots.append(str(path.relative_to(common.BENCH_DIR)))
    return report


def _plot(rows: list[dict[str, Any]], path: Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in zip(axes, ("admit", "decode"), ("admission step", "decode step")):
        labels = [str(r["waiting"]) for r in rows]
        x = range(len(rows))
        for offset, v, color in ((-0.2, "with", "tab:blue"), (0.2, "without", "tab:gray")):
            stats = [Stat.of(r[key][v]) for r in rows]
            ax.bar(
                [i + offset for i in x],
                [s.median * 1e3 for s in stats],
                width=0.4,
                color=color,
                yerr=[[(s.median - s.low) * 1e3 for s in stats], [(s.high - s.median) * 1e3 for s in stats]],
                capsize=3,
                label=f"{v} connector",
            )
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("waiting requests")
        ax.set_ylabel("ms (median, min..max)")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(common.main("benchmarks.scheduler_overhead", __doc__, run))
