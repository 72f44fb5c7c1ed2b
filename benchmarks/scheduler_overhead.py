"""Scheduler overhead: vLLM scheduler step time with KVPoolConnector (no hits) vs without a connector.

Three real vLLM ``Scheduler`` objects, identical but for the connector (full
attention + a sliding window): KVPoolConnector (the pool is empty, so every
lookup misses and every computed block is planned for saving), none, and
``testing.deferring_connector`` (a connector that only answers each request's
first lookup ``None`` and finds nothing: what vLLM itself spends on asynchronous
lookups, the floor of any connector that makes them). Each repetition adds N waiting
requests (fresh 128-token prompts) to each and runs steps (``schedule`` +
``update_from_output`` with one sampled token each) until every request is
admitted: the connector's lookups are batched, so its scheduler skips the
requests in the step that queues their lookups and admits them in a later
one. Admission is the scheduler time summed over those steps; after each, the
benchmark waits, untimed, until the connector's presence service has answered
the lookups and their statistics' existence checks (in an engine the model's
forward runs then), and reports that wait apart, with the pause an idle step
takes for its lookups (``IDLE_STEP_WAIT_S``); ``testing.scheduler.PresenceMeter``
counts the checks and times the pauses. Then the decode steps
after it are timed; requests are then aborted (untimed). A last pass, not in
the ratios, times each of the connector's hooks over a few more admissions:
where the extra time per admitted request goes, and what is left for vLLM's
own part (the skipped step, its local prefix lookup asked again), which the
deferring connector measures directly.
"""

from __future__ import annotations

import gc
import random
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import Options, Report, Stat, Table, Target, ratios, rotate, stopwatch
from benchmarks.vllm_env import bench_scheduler, ours_transfer, tiny_long_model
from kvpool.connector.contract.settings import ConnectorSettings
from testing.deferring_connector import TRANSFER as DEFERRING_TRANSFER
from testing.engine import scheduler_of
from testing.kv_cache import GroupDesc
from testing.scheduler import PresenceMeter, make_request, settle

WAITING = (64, 256)
SMOKE_WAITING = (8,)
PROMPT = 128
DECODE_STEPS = 24  # a decode step is ~3 ms at 64 running: a median over 8 moved by ±5% from run to run
MAX_ADMIT_STEPS = 20
GROUPS = [GroupDesc("full"), GroupDesc("sliding_window", window=128)]
VARIANTS = ("with", "deferring", "without")
# The breakdown pass times our hooks: it runs only the two schedulers it compares.
BREAKDOWN_VARIANTS = ("with", "without")
BAR_LABELS = {"with": "KVPoolConnector", "deferring": "deferring only", "without": "no connector"}
# The connector's scheduler-side hooks vLLM calls, timed apart in the breakdown pass.
HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "get_kv_connector_stats",
    "take_events",
    "request_finished_all_groups",
)
# 15: with 7 the hooks' median moved by ±2 µs from run to run (36-41 µs on 2026-12-05).
BREAKDOWN_CYCLES = 15
#: Issue #32: the connector's scheduler hooks per admitted request, summed (µs).
HOOKS_GOAL_US = 40.0
LOOKUP_BUDGET_MS: float = ConnectorSettings.model_fields["lookup_budget_ms"].default


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


def _admit(scheduler: Any, count: int, meter: PresenceMeter | None) -> tuple[float, float, int, int]:
    """Steps until ``count`` waiting requests are all admitted: (scheduler s summed over them,
    s waited between them for the lookups' answers, steps, existence checks made).

    ``meter``: KVPoolConnector's, None with another connector or none.
    """
    checks = 0 if meter is None else meter.checks
    busy = waited = 0.0
    admitted: set[str] = set()
    steps = 0
    while len(admitted) < count:
        if steps == MAX_ADMIT_STEPS:
            raise RuntimeError(f"admitted {len(admitted)} of {count} waiting requests in {steps} steps")
        paused_before = 0.0 if meter is None else meter.idle_paused_s + meter.budget_waited_s
        output, seconds = _step(scheduler)
        # An idle step's pause for its lookups, and a request's wait for its lookup's answer
        # within the step's budget, are waiting for the master, not scheduler work.
        paused = 0.0 if meter is None else meter.idle_paused_s + meter.budget_waited_s - paused_before
        busy += seconds - paused
        waited += paused
        steps += 1
        admitted.update(output.num_scheduled_tokens)
        if meter is not None:  # the presence service finishes what the step started
            with stopwatch() as t:
                if not settle(scheduler.connector):
                    raise RuntimeError("lookups or their statistics unanswered after 30 s")
            waited += t[0]
    return busy, waited, steps, 0 if meter is None else meter.checks - checks


class HookTimer:
    """Seconds spent inside each of the connector's hooks while :attr:`on` (the breakdown pass)."""

    def __init__(self, connector: Any):
        self.on = False
        self.seconds: dict[str, float] = dict.fromkeys(HOOKS, 0.0)
        for name in HOOKS:
            setattr(connector, name, self._timed(name, getattr(connector, name)))

    def _timed(self, name: str, hook: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return hook(*args, **kwargs)
            started = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started

        return timed

    def take(self) -> dict[str, float]:
        taken, self.seconds = self.seconds, dict.fromkeys(HOOKS, 0.0)
        return taken


def _breakdown(
    schedulers: dict[str, Any], timer: HookTimer, meter: PresenceMeter, n: int, rng: random.Random
) -> dict[str, Any]:
    """Per admitted request, µs, the median over :data:`BREAKDOWN_CYCLES` admissions: each
    hook's time, and the rest of the difference (vLLM's own work for the connector: the
    skipped step, its local lookup asked again); ``hooks``: each admission's hooks summed.

    Medians, not sums: one garbage collection of vLLM's heap (milliseconds) inside a hook
    would otherwise move an admission's mean by tens of µs per request.
    """
    presence = scheduler_of(schedulers["with"].connector).presence
    cycles: list[dict[str, float]] = []
    for _ in range(BREAKDOWN_CYCLES):
        per_hook = dict.fromkeys(HOOKS, 0.0)
        admit = {v: 0.0 for v in BREAKDOWN_VARIANTS}
        waited_in_budget = service_cpu = 0.0
        for v in BREAKDOWN_VARIANTS:
            requests = _add(schedulers[v], [[rng.randrange(3, 500) for _ in range(PROMPT)] for _ in range(n)])
            timer.on = v == "with"
            paused, budget_waited = meter.idle_paused_s, meter.budget_waited_s
            cpu_before = presence.cpu_seconds
            admit[v] = _admit(schedulers[v], len(requests), meter if v == "with" else None)[0]
            if v == "with":  # its lookups and their statistics, answered by now (_admit settles)
                service_cpu = presence.cpu_seconds - cpu_before
            timer.on = False
            if v == "with":
                per_hook.update(timer.take())
                # The idle step's pause for the lookups is not scheduler work (as in _admit).
                per_hook["build_connector_meta"] -= meter.idle_paused_s - paused
                # So is the wait for the master within the step's lookup budget.
                waited_in_budget = meter.budget_waited_s - budget_waited
                per_hook["get_num_new_matched_tokens"] -= waited_in_budget
            _finish(schedulers[v], requests)
        scale = 1e6 / n
        cycle = {name: seconds * scale for name, seconds in per_hook.items()}
        cycle["hooks"] = sum(per_hook.values()) * scale
        cycle["total"] = (admit["with"] - admit["without"]) * scale
        cycle["vllm"] = cycle["total"] - cycle["hooks"]
        cycle["budget_wait"] = waited_in_budget * scale  # not in total: _admit counts it as waiting
        cycle["service_cpu"] = service_cpu * scale  # on another thread: not in total either
        cycles.append(cycle)
    out: dict[str, Any] = {key: Stat.of([c[key] for c in cycles]).median for key in cycles[0]}
    out["hooks_per_cycle"] = [c["hooks"] for c in cycles]
    return out


def _add(scheduler: Any, prompts: list[list[int]]) -> list[Any]:
    requests = [make_request(scheduler, p, max_tokens=DECODE_STEPS + 4) for p in prompts]
    for r in requests:
        scheduler.add_request(r)
    return requests


def _finish(scheduler: Any, requests: list[Any]) -> None:
    from vllm.v1.request import RequestStatus

    scheduler.finish_requests([r.request_id for r in requests], RequestStatus.FINISHED_ABORTED)
    _step(scheduler)  # hands the finished ids to the connector, as the next real step would


def _cycle(scheduler: Any, prompts: list[list[int]], meter: PresenceMeter | None) -> dict[str, float]:
    """Admit ``prompts`` and decode: admission's scheduler s, wait s, steps and existence checks;
    the median decode step s."""
    requests = _add(scheduler, prompts)
    admit, waited, steps, calls = _admit(scheduler, len(requests), meter)
    decode = [_step(scheduler)[1] for _ in range(DECODE_STEPS)]
    _finish(scheduler, requests)
    return {
        "admit": admit,
        "waited": waited,
        "steps": steps,
        "calls": calls,
        "decode": Stat.of(decode).median,
    }


def run(opts: Options) -> Report:
    from vllm.utils.gc_utils import freeze_gc_heap

    from kvpool.connector.local.pool import LocalPool
    from kvpool.connector.local.recording import Recording

    # 25: a run takes seconds, and with 9 the decode ratios moved by ±0.06 from run to run.
    reps = opts.repetitions(25)
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
            # The product's lookup budget (testing's make_scheduler would set 0 otherwise).
            "with": bench_scheduler(
                model, GROUPS, ours_transfer(lp.address, "sched", lookup_budget_ms=LOOKUP_BUDGET_MS), **kwargs
            ),
            "deferring": bench_scheduler(model, GROUPS, dict(DEFERRING_TRANSFER), **kwargs),
            "without": bench_scheduler(model, GROUPS, None, **kwargs),
        }
        recording = Recording()  # the lookups' own timings
        recording.tap(schedulers["with"].connector.stats)
        timer = HookTimer(schedulers["with"].connector)  # off but in the breakdown pass
        meters = {"with": PresenceMeter(schedulers["with"].connector)}
        try:
            for n in sizes:
                for v in VARIANTS:  # warm-up
                    prompts = [[rng.randrange(3, 500) for _ in range(PROMPT)] for _ in range(n)]
                    _cycle(schedulers[v], prompts, meters.get(v))
                freeze_gc_heap()  # as vLLM's EngineCore does after start-up
                seen = len(recording.lookups)
                measured: dict[str, dict[str, list[float]]] = {
                    key: {v: [] for v in VARIANTS} for key in ("admit", "waited", "steps", "calls", "decode")
                }
                for rep in range(reps):
                    for v in rotate(VARIANTS, rep):
                        prompts = [[rng.randrange(3, 500) for _ in range(PROMPT)] for _ in range(n)]
                        for key, value in _cycle(schedulers[v], prompts, meters.get(v)).items():
                            measured[key][v].append(value)
                lookups = [rec.seconds for rec in recording.lookups[seen:]]
                breakdown = _breakdown(schedulers, timer, meters["with"], n, rng)
                rows.append({"waiting": n, **measured, "lookup_seconds": lookups, "breakdown": breakdown})
                print(f"  {n} waiting: done", file=sys.stderr, flush=True)
        finally:
            gc.unfreeze()
            for s in schedulers.values():
                s.shutdown()
    return _report(rows, reps, opts)


def _report(rows: list[dict[str, Any]], reps: int, opts: Options) -> Report:
    report = Report("scheduler_overhead", "5. Scheduler step: with KVPoolConnector (no hits) vs without", "")
    table = Table(
        f"scheduler time ms, median (min..max) of {reps}; ratios over without, paired per repetition; "
        "'deferring only': a connector that answers each request's first lookup None and does nothing "
        "else (the floor of asynchronous lookups)",
        [
            "waiting",
            "step",
            "with connector ms",
            "deferring only ms",
            "without ms",
            "ratio (with)",
            "ratio (deferring only)",
            "with / deferring only",
            "per request µs (with - without)",
            "per request µs (deferring - without)",
        ],
    )
    for r in rows:
        for step, key in (
            ("admission (all steps until every request is admitted)", "admit"),
            (f"decode (median of {DECODE_STEPS})", "decode"),
        ):
            w, d, wo = (Stat.of(r[key][v]) for v in VARIANTS)
            ratio = ratios(r[key]["with"], r[key]["without"])
            floor = ratios(r[key]["deferring"], r[key]["without"])
            over_floor = ratios(r[key]["with"], r[key]["deferring"])
            r[f"{key}_ratio"] = ratio.median
            r[f"{key}_floor_ratio"] = floor.median
            r[f"{key}_over_floor"] = over_floor.median
            table.add(
                r["waiting"],
                step,
                w.fmt(1e3),
                d.fmt(1e3),
                wo.fmt(1e3),
                ratio.ratio(),
                floor.ratio(),
                over_floor.ratio(),
                f"{(w.median - wo.median) / r['waiting'] * 1e6:.0f}",
                f"{(d.median - wo.median) / r['waiting'] * 1e6:.0f}",
            )
    report.tables.append(table)
    own = Table(
        "admission with the connector: steps, the batched existence checks (the lookups', then their "
        "statistics'), and the wait after each step for the presence service's thread (untimed above: "
        "in an engine the model's forward runs then)",
        [
            "waiting",
            "steps to admit all (with / deferring only / without)",
            "existence checks per admission",
            "wait for the thread ms",
            "lookup ms per request (first call to answer)",
        ],
    )
    for r in rows:
        st = Stat.of(r["lookup_seconds"]) if r["lookup_seconds"] else None
        own.add(
            r["waiting"],
            " / ".join(f"{Stat.of(r['steps'][v]).median:.0f}" for v in VARIANTS),
            f"{Stat.of(r['calls']['with']).median:.0f} (max {max(r['calls']['with']):.0f})",
            Stat.of(r["waited"]["with"]).fmt(1e3),
            "-" if st is None else st.fmt(1e3, 3),
        )
    report.tables.append(own)
    parts = Table(
        f"where admission's extra time goes: µs per admitted request, median of {BREAKDOWN_CYCLES} further "
        "admissions with the connector's hooks timed (not in the tables above)",
        [
            "waiting",
            *HOOKS,
            "hooks in all",
            "vLLM's own (the rest)",
            "extra in all",
            "waited for the master in step",
            "presence thread's CPU (lookups, statistics)",
        ],
    )
    for r in rows:
        b = r["breakdown"]
        columns = (*HOOKS, "hooks", "vllm", "total", "budget_wait", "service_cpu")
        cells = [f"{b[name]:.1f}" for name in columns]
        parts.add(r["waiting"], *cells)
    report.tables.append(parts)
    worst = max(r["admit_ratio"] for r in rows)
    report.targets.append(
        Target(
            "admission (scheduler time over its steps) ≤ 1.1x without connector",
            f"worst median {worst:.2f}x",
            worst <= 1.1,
            retired="issue #32: asynchronous lookups cannot beat the deferring-only floor; "
            "replaced by the floor and hook targets",
        )
    )
    over_floor = max(r["admit_over_floor"] for r in rows)
    report.targets.append(
        Target(
            "admission ≤ 1.1x the deferring-only floor",
            f"worst median {over_floor:.2f}x",
            over_floor <= 1.1,
        )
    )
    hooks = max(r["breakdown"]["hooks"] for r in rows)
    report.targets.append(
        Target(
            f"the connector's own hooks ≤ {HOOKS_GOAL_US:g} µs per admitted request",
            f"worst median {hooks:.1f} µs",
            hooks <= HOOKS_GOAL_US,
        )
    )
    floor_worst = max(r["admit_floor_ratio"] for r in rows)
    report.targets.append(
        Target(
            "(admission's floor: a connector that only defers each request one step, not a stated target)",
            f"worst median {floor_worst:.2f}x",
            None,
        )
    )
    decode_worst = max(r["decode_ratio"] for r in rows)
    report.targets.append(
        Target(
            "decode step ≤ 1.05x without connector", f"worst median {decode_worst:.2f}x", decode_worst <= 1.05
        )
    )
    report.notes.append(
        "Lookups are batched: the step that first sees the waiting requests queues their lookups and "
        "schedules none of them; the lookups go to the master in one batch_is_exist (per round of the "
        "hybrid fixed point) on the presence service's thread when the step ends, and the next step "
        "admits them. Admission counts the scheduler's time in all those steps, including the save plan "
        "of every admitted request; decode steps include the per-step save planning."
    )
    report.notes.append(
        "'deferring only' (testing/deferring_connector.py) is the protocol alone: vLLM skips each "
        "request in the step that first sees it and runs its local prefix lookup again in the next. "
        "No connector that answers lookups a step later can admit faster than it on this vLLM, so its "
        "ratio bounds from below what the admission target can reach with asynchronous lookups."
    )
    # What "1.1x the floor" leaves the connector, per admitted request, against its hooks' time.
    room = min(0.1 * Stat.of(r["admit"]["deferring"]).median / r["waiting"] * 1e6 for r in rows)
    report.notes.append(
        f"Admission within 1.1x the deferring-only floor leaves the connector at most {room:.0f} µs "
        f"per admitted request at the floor's own speed in this run; its hooks took {hooks:.0f} µs at "
        "worst (a lookup queued and taken, a save planned, statistics exported): the floor target "
        "needs the hook target met several times over, so the two are not met together here."
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
    for ax, key, title in zip(axes, ("admit", "decode"), ("admission (all its steps)", "decode step")):
        labels = [str(r["waiting"]) for r in rows]
        x = range(len(rows))
        bars = ((-0.27, "with", "tab:blue"), (0.0, "deferring", "tab:orange"), (0.27, "without", "tab:gray"))
        for offset, v, color in bars:
            stats = [Stat.of(r[key][v]) for r in rows]
            ax.bar(
                [i + offset for i in x],
                [s.median * 1e3 for s in stats],
                width=0.27,
                color=color,
                yerr=[[(s.median - s.low) * 1e3 for s in stats], [(s.high - s.median) * 1e3 for s in stats]],
                capsize=3,
                label=BAR_LABELS[v],
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
