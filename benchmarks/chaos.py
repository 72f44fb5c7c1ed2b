"""Chaos: a fleet of vLLM servers on one HA pool under seeded faults; every answer checked.

Real parts on loopback (:mod:`benchmarks.chaos_fleet`): a three-member etcd, two HA Mooncake
masters electing through it, two store processes, and two vLLM OpenAI API servers with the
connector (CPU, one core each, the serving benchmark's tiny Gemma3), serving multi-turn
conversations on shared system prompts at a steady rate, some clients hanging up early
(:mod:`benchmarks.chaos_traffic`). Faults from a seeded schedule (:mod:`testing.chaos_schedule`,
:mod:`benchmarks.chaos_faults`), each kind several times, some overlapping: a store frozen,
a store killed and restarted, the leading master killed, an etcd member killed and
restarted, a server killed with requests in flight and restarted, the pool filled past its
capacity, stored objects overwritten under their headers. Every request, fault and sample is
a line of ``history.jsonl`` (:mod:`testing.chaos_history`); the judgement
(:mod:`testing.chaos_judgement`) reads it against references from a server without any
cache (no prefix caching, no connector; greedy, token ids):

* no wrong answer; no request past ``REQUEST_BOUND_S`` (refusals counted, those during a
  server's restart apart); the pool hit rate back to half its level within
  ``RECOVERY_BOUND_S`` of each fault's end; servers' RSS, threads and fds flat after warm-up;
  ``/metrics`` agreeing with the history;
* a negative control after the chaos phase: the same fleet with the payload check switched
  off (:mod:`testing.guard_switch`, test-only) while objects are overwritten; the judgement
  must find wrong answers.

A slowed or lossy link (``tc netem`` in a network namespace) is not among the faults where
the kernel has no ``sch_netem`` (this machine's: ``tc`` answers "Specified qdisc kind is
unknown"); the report says so.

``--colocated`` runs the fleet without store processes: each server's connector holds a
segment of the pool (``global_segment_size``), so a server reads its own segment directly
and its peer's over TCP. Store faults give way to ``server_frozen`` (a server stopped, its
segment stalling its peer's transfers); a restarted server loses its segment's objects.

``--smoke`` is the short variant the test suite runs (~2 minutes of traffic, every kind once);
without it, 20 minutes, every kind three times. ``--out DIR`` keeps the history there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import common, pool
from benchmarks.chaos_faults import Injector, PoolHands
from benchmarks.chaos_fleet import STARTUP_TIMEOUT_S, Fleet
from benchmarks.chaos_traffic import Traffic, Workload, references
from benchmarks.common import MODELS_DIR, Options, Report, Stat, Table, Target
from benchmarks.serving import BLOCK_SIZE, ApiServer
from testing import chaos_history as ch
from testing import chaos_judgement as judge
from testing.chaos_schedule import FaultKind, PlannedFault, plan

#: The faults of a fleet whose stores hold the pool, and of one whose servers do (co-located).
KINDS = [k for k in FaultKind if k not in (FaultKind.SLOW_LINK, FaultKind.SERVER_FROZEN)]
COLOCATED_KINDS = [
    k for k in FaultKind if k not in (FaultKind.SLOW_LINK, FaultKind.STORE_FROZEN, FaultKind.STORE_RESTARTED)
]
#: A request's allowance for queueing, prefill and decode on this machine's two busy cores,
#: with no pool at all (the tiny model answers in well under a second when idle).
COMPUTE_ALLOWANCE_S = 60.0
RECOVERY_BOUND_S = 90.0
RECOVERY_FRACTION = 0.5
SAMPLE_EVERY_S = 2.0
OVERRUN_S = 300.0  # the longest the traffic goes on past its length, waiting for faults to end
LEAK_WARMUP_S = 60.0
CACHE_PREFIX = "chaos"


@dataclass(frozen=True)
class Shape:
    """How long and how hard a run is."""

    traffic_s: float
    per_kind: int
    fault_start_s: float
    fault_tail_s: float  # no fault starts this close to the traffic's end
    max_hold_s: float | None
    window_s: float  # the hit rate's window
    control_s: float  # the negative control's traffic
    control_corruptions: int
    settle_s: float  # traffic after the last fault ended (its recovery is judged in it)


SHORT = Shape(120.0, 1, 25.0, 25.0, 6.0, 10.0, 36.0, 3, 30.0)
FULL = Shape(1200.0, 3, 60.0, 120.0, None, 20.0, 60.0, 6, 60.0)


def kinds_of(colocated: bool) -> list[FaultKind]:
    return COLOCATED_KINDS if colocated else KINDS


def connector_extra(segment_size: str | None = None) -> dict[str, Any]:
    """Settings beyond the address: hits always load where the connector can choose (the
    run is about loads under faults); ``segment_size``: the memory each server holds."""
    from kvpool.connector.contract.settings import ConnectorSettings

    extra: dict[str, Any] = {}
    if "load_policy" in ConnectorSettings.model_fields:
        extra["load_policy"] = "always"
    if segment_size is not None:
        extra["global_segment_size"] = segment_size
    return extra


def request_bound_s(settings: Any) -> float:
    """How long a request may take before it counts as hung: the compute allowance plus every
    pool wait the connector bounds on its path (a lookup, a load's batches, which read ahead
    at most two batches for these prompts, and a save holding its blocks)."""
    return (
        COMPUTE_ALLOWANCE_S
        + settings.lookup_timeout_s
        + 2 * settings.load_timeout_s
        + settings.save_timeout_s
    )


# --- sampling -------------------------------------------------------------------------------
def flat_series(parsed: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
    """The counters the judgement reads, ``name{label="value",...}``."""
    keep = ("vllm:kvpool_", "vllm:request_success_total", "vllm:prompt_tokens")
    out = {}
    for (name, labels), value in parsed.items():
        if name.startswith(keep) and not name.endswith("_created"):
            key = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else "")
            out[key] = value
    return out


def proc_totals(pid: int) -> tuple[int, int, int]:
    """RSS, threads and fds of a process and its descendants, summed."""
    import psutil

    root = psutil.Process(pid)
    rss = threads = fds = 0
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            rss += proc.memory_info().rss
            threads += proc.num_threads()
            fds += proc.num_fds()
    return rss, threads, fds


@dataclass
class Sampler:
    """Every ``SAMPLE_EVERY_S``: each server's ``/proc`` and ``/metrics`` into the history."""

    fleet: Fleet
    t0: float
    add: Any
    fingerprint: dict[str, str] | None = None  # vllm:kvpool_key_fingerprint_info's labels
    stop_event: threading.Event = field(default_factory=threading.Event)

    def once(self) -> None:
        now = time.monotonic() - self.t0
        for index, generation, server in self.fleet.servers_now():
            process = server.process
            if process is None or process.poll() is not None:
                continue
            with contextlib.suppress(Exception):
                self.add(ch.ProcSample(round(now, 2), index, generation, *proc_totals(process.pid)))
            try:
                parsed = server.metrics()
            except OSError:
                continue  # starting, or gone
            for (name, labels), _ in parsed.items():
                if name == "vllm:kvpool_key_fingerprint_info":
                    self.fingerprint = dict(labels)
            self.add(ch.MetricsSample(round(now, 2), index, generation, flat_series(parsed)))

    def start(self) -> threading.Thread:
        def run() -> None:
            while not self.stop_event.wait(SAMPLE_EVERY_S):
                self.once()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


# --- the run -----------------------------------------------------------------------------------
@dataclass
class Outcome:
    history: ch.History
    references: dict[str, list[int]]
    schedule: list[PlannedFault]
    final_generations: dict[int, int]
    bound_s: float
    workload: Workload
    shape: Shape
    kv_cache_tokens: list[int | None]
    wall_seconds: float | None = None  # the whole run's, set once it ended
    colocated: bool = False

    def save(self, out_dir: Path) -> None:
        """Everything but the history (``history.jsonl`` beside it): the run can be judged again."""
        fields = {
            "references": self.references,
            "schedule": [asdict(f) for f in self.schedule],
            "final_generations": self.final_generations,
            "bound_s": self.bound_s,
            "workload": asdict(self.workload),
            "shape": asdict(self.shape),
            "kv_cache_tokens": self.kv_cache_tokens,
            "wall_seconds": self.wall_seconds,
            "colocated": self.colocated,
        }
        (out_dir / "outcome.json").write_text(json.dumps(fields) + "\n")

    @classmethod
    def load(cls, out_dir: Path) -> Outcome:
        fields = json.loads((out_dir / "outcome.json").read_text())
        return cls(
            ch.read(out_dir / "history.jsonl"),
            fields["references"],
            [PlannedFault(FaultKind(f.pop("kind")), **f) for f in fields["schedule"]],
            {int(k): v for k, v in fields["final_generations"].items()},
            fields["bound_s"],
            Workload(**fields["workload"]),
            Shape(**fields["shape"]),
            fields["kv_cache_tokens"],
            fields.get("wall_seconds"),
            fields.get("colocated", False),
        )


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def run_fleet(shape: Shape, wl: Workload, seed: int, out_dir: Path, colocated: bool = False) -> Outcome:
    """Start everything, warm up, play the traffic and the faults, the negative control, then
    stop the fleet and compute the references; every process is stopped on the way out."""
    from testing.guard_switch import server_env
    from testing.models import build_gemma3
    from testing.prompts import block_hashes

    os.environ.setdefault("PYTHONHASHSEED", "0")  # every server hashes blocks alike
    model = build_gemma3(MODELS_DIR / "bench-gemma3-tiny")
    switch = out_dir / "payload-check-off"
    switch.unlink(missing_ok=True)
    env = server_env(switch, out_dir / "site")
    fleet = Fleet(model, stores=0 if colocated else 2, colocated=colocated, server_env=env)
    # The references' server: no cache, no connector; its worker in the engine core's process.
    reference = ApiServer(
        model,
        _cores()[-1],
        prefix_caching=False,
        kv_cache_bytes=fleet.kv_cache_bytes,
        own_worker_process=False,
    )
    history = ch.History()
    lock = threading.Lock()
    sink = (out_dir / "history.jsonl").open("w")

    def add(record: ch.Record) -> None:
        with lock:
            history.add(record)
            sink.write(ch.line(record) + "\n")
            sink.flush()

    hands: PoolHands | None = None
    sampler: Sampler | None = None
    try:
        fleet.start_pool()
        segment = fleet.segment_size if colocated else None
        settings = pool.settings(fleet.address, CACHE_PREFIX, **connector_extra(segment))
        fleet.transfer_config = settings.kv_transfer_config()
        bound = request_bound_s(settings)
        fleet.start_servers(_cores())
        reference.start()
        fleet.wait_servers()
        _log(f"fleet ready: pool {fleet.address}, servers {[fleet.url(i) for i in range(fleet.servers)]}")
        warm = [[(7 * i + j) % wl.vocab + 3 for j in range(wl.system_len)] for i in range(fleet.servers)]
        for i in range(fleet.servers):
            asyncio.run(references(fleet.url(i), [warm[i]], wl.answer_len))
        t0 = time.monotonic()
        sampler = Sampler(fleet, t0, add)
        sampler.once()
        sampler.start()
        hands = PoolHands(fleet.address, CACHE_PREFIX, lambda: sampler.fingerprint if sampler else None)
        hands.store()  # the harness's client, and vLLM's block hashing, loaded before the traffic
        block_hashes([1] * BLOCK_SIZE)
        schedule = plan(
            seed,
            start=shape.fault_start_s,
            end=shape.traffic_s - shape.fault_tail_s,
            kinds=kinds_of(colocated),
            per_kind=shape.per_kind,
            targets={
                FaultKind.STORE_FROZEN: fleet.stores,
                FaultKind.STORE_RESTARTED: fleet.stores,
                FaultKind.ETCD_MEMBER_RESTARTED: 3,
                FaultKind.SERVER_RESTARTED: fleet.servers,
                FaultKind.SERVER_FROZEN: fleet.servers,
            },
            max_hold=shape.max_hold_s,
        )
        _log("schedule: " + ", ".join(f"{f.kind}@{f.at:.0f}s" for f in schedule))
        urls = [fleet.url(i) for i in range(fleet.servers)]  # ports survive restarts
        client_timeout = bound + 30.0
        traffic = Traffic(wl, lambda: urls, t0, client_timeout, add)
        injector = Injector(fleet, traffic, hands, t0, add, system_blocks=wl.system_len // BLOCK_SIZE)
        injector.play(schedule)
        # The traffic goes on until every fault has ended and the fleet had time to heal, within
        # a bound: a fault that never ends fails the judgement, it does not hang the run.
        overrun = t0 + shape.traffic_s + OVERRUN_S
        asyncio.run(
            traffic.run(
                shape.traffic_s,
                lambda: not injector.settled(shape.settle_s) and time.monotonic() < overrun,
            )
        )
        injector.wait(timeout=STARTUP_TIMEOUT_S)
        _log(f"chaos phase done: {len(history.requests)} requests, {len(history.faults)} faults")

        # The negative control: the same fleet, payload check off, objects overwritten.
        switch.touch()
        control = Traffic(wl, lambda: urls, t0, client_timeout, add, phase="control", first_user=1_000_000)
        control_injector = Injector(
            fleet, control, hands, t0, add, phase="control", system_blocks=wl.system_len // BLOCK_SIZE
        )
        begin = time.monotonic() - t0
        every = shape.control_s / (shape.control_corruptions + 1)
        control_injector.play(
            [
                PlannedFault(FaultKind.OBJECTS_CORRUPTED, begin + every * (i + 1), 0.0, 0)
                for i in range(shape.control_corruptions)
            ]
        )
        asyncio.run(control.run(shape.control_s))
        control_injector.wait(timeout=60.0)
        switch.unlink(missing_ok=True)
        time.sleep(SAMPLE_EVERY_S * 2)  # the last steps reach /metrics
        sampler.stop_event.set()
        sampler.once()
        final = {i: g for i, g, _ in fleet.servers_now()}
        fleet.stop(keep_logs_in=out_dir)

        prompts = {ch.prompt_key(r.prompt): r.prompt for r in history.requests if r.tokens}
        reference.wait_ready(time.monotonic() + STARTUP_TIMEOUT_S)
        answers = asyncio.run(references(reference.url, list(prompts.values()), wl.answer_len))
        refs = dict(zip(prompts, answers, strict=True))
        caches = [reference.kv_cache_tokens()]
    finally:
        if sampler is not None:
            sampler.stop_event.set()
        switch.unlink(missing_ok=True)
        fleet.stop(keep_logs_in=out_dir)
        reference.stop()
        if reference.log_path.exists():
            shutil.move(reference.log_path, out_dir / "reference-server.log")
        if hands is not None:
            hands.close()
        sink.close()
    outcome = Outcome(history, refs, schedule, final, bound, wl, shape, caches, colocated=colocated)
    outcome.save(out_dir)
    return outcome


def _log(text: str) -> None:
    print(f"[chaos] {text}", file=sys.stderr, flush=True)


# --- the judgement and the report ----------------------------------------------------------------
def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return "never" if math.isinf(value) else f"{value:.0f}"


def judge_outcome(out: Outcome) -> Report:
    chaos = out.history.phase("chaos")
    control = out.history.phase("control")
    shape = out.shape
    timeline = judge.hit_rate_timeline(out.history.metrics, shape.window_s)
    fates = judge.fates(chaos.requests, chaos.faults, out.bound_s)
    wrong = judge.wrong_answers(chaos.requests, out.references)
    control_wrong = judge.wrong_answers(control.requests, out.references)
    control_fates = judge.fates(control.requests, control.faults, out.bound_s)
    control_loaded = (
        judge.loaded_blocks(
            out.history.metrics,
            min(r.sent for r in control.requests),
            # The phase's last loads reach /metrics by the sample after its last request.
            max(r.ended or r.sent for r in control.requests) + 2 * SAMPLE_EVERY_S,
        )
        if control.requests
        else 0.0
    )
    kinds = judge.by_kind(chaos, fates, wrong, timeline, shape.window_s, fraction=RECOVERY_FRACTION)
    leaks = judge.leaks(out.history.procs, LEAK_WARMUP_S)
    disagreements = judge.metrics_disagreements(out.history, final_generations=out.final_generations)
    kinds_run = kinds_of(out.colocated)
    injected = {
        k.value: sum(1 for f in chaos.faults if f.kind == k.value and f.error is None) for k in kinds_run
    }
    failed_injections = [f for f in chaos.faults if f.error is not None]
    recoveries = [r for row in kinds for r in row.recoveries]

    report = (
        Report("chaos_colocated", "10b. Chaos, co-located: servers holding the pool, under random faults", "")
        if out.colocated
        else Report("chaos", "10. Chaos: a serving fleet under random faults", "")
    )
    table = Table(
        f"per fault kind ({shape.traffic_s / 60:.0f} min of traffic, seed in the command): requests "
        f"sent while a fault held (or within {shape.window_s:.0f} s after); recovery: seconds from "
        f"the fault's end until the fleet's pool hit rate is back to {RECOVERY_FRACTION:.0%} of "
        f"its level before it ({shape.window_s:.0f} s windows)",
        [
            "fault",
            "injected",
            "injection failed",
            "wrong",
            "hung",
            "refused",
            "recovery p50 s",
            "max s",
            "no level before",
        ],
    )
    for row in kinds:
        table.add(
            row.kind,
            injected.get(row.kind, 0),
            sum(1 for f in failed_injections if f.kind == row.kind),
            row.wrong,
            row.hung,
            row.refused,
            _fmt(row.recovery_p50),
            _fmt(row.recovery_max),
            row.unjudged,
        )
    table.add(FaultKind.SLOW_LINK.value, "n/a", "-", "-", "-", "-", "-", "-", "-")
    report.tables.append(table)

    requests = Table(
        "requests by how they ended; TTFT of completed ones, s: median (min..max)",
        [
            "phase",
            "sent",
            "completed",
            "hung up by client",
            "refused in a restart or freeze",
            "refused",
            "failed",
            "hung",
            "wrong",
            "TTFT",
        ],
    )
    for name, f, w, recs in (
        ("chaos", fates, wrong, chaos.requests),
        ("control (check off)", control_fates, control_wrong, control.requests),
    ):
        ttfts = [r.first - r.sent for r in f.completed if r.first is not None]
        requests.add(
            name, len(recs), len(f.completed), len(f.disconnected), len(f.refused_in_restart),
            len(f.refused), len(f.failed), len(f.hung), len(w),
            Stat.of(ttfts).fmt(digits=3) if ttfts else "-",
        )  # fmt: skip
    report.tables.append(requests)

    failures = judge.failure_counts(out.history.metrics)
    series = Table(
        "vllm:kvpool_failures_total by reason (every server generation, both phases)",
        ["reason", "count"],
    )
    for reason, count in sorted(failures.items()):
        series.add(reason, f"{count:.0f}")
    report.tables.append(series)

    judged = [r for r in recoveries if not math.isinf(r)]
    judged_answers = len(fates.completed) + len(fates.disconnected)
    report.targets += [
        Target("no wrong answer", f"{len(wrong)} wrong of {judged_answers} judged", not wrong),
        Target(
            f"no request hangs (bound {out.bound_s:.0f} s)",
            f"{len(fates.hung)} hung; {len(fates.refused_in_restart)} refused in a restart or freeze, "
            f"{len(fates.refused)} refused otherwise",
            not fates.hung,
        ),
        Target(
            "no stream breaks but by a server restart" + (" or freeze" if out.colocated else ""),
            f"{len(fates.failed)} failed",
            not fates.failed,
        ),
        Target(
            f"every fault kind injected at least {shape.per_kind} time(s)",
            ", ".join(f"{k} {n}" for k, n in injected.items()),
            all(n >= shape.per_kind for n in injected.values()),
        ),
        Target(
            f"hit rate back to {RECOVERY_FRACTION:.0%} within {RECOVERY_BOUND_S:.0f} s of each fault",
            f"{sum(r <= RECOVERY_BOUND_S for r in recoveries)} of {len(recoveries)} recovered in time; "
            f"slowest {max(judged, default=0.0):.0f} s",
            all(r <= RECOVERY_BOUND_S for r in recoveries),
        ),
        Target("servers' RSS, threads and fds flat after warm-up", "; ".join(leaks) or "flat", not leaks),
        Target("/metrics agree with the history", "; ".join(disagreements) or "agree", not disagreements),
        Target(
            "negative control (payload check off, objects overwritten): wrong answers found",
            f"{len(control_wrong)} wrong of {len(control_fates.completed)} completed; "
            f"{control_loaded:.0f} blocks loaded from the pool in the phase",
            bool(control_wrong),
        ),
    ]  # fmt: skip
    report.notes += [
        f"Workload: {out.workload.describe()}.",
        "Fleet: 2 vLLM API servers (tiny Gemma3, CPU, one core each, prefix caching, connector "
        "with hits always loaded), 2 HA masters on a 3-member etcd, "
        + (
            "no store process: each server's connector holds a 256 MB segment of the pool; "
            if out.colocated
            else "2 stores of 256 MB; "
        )
        + f"references from a server without any cache (KV cache {out.kv_cache_tokens[0]} tokens).",
        f"Request bound {out.bound_s:.0f} s = {COMPUTE_ALLOWANCE_S:.0f} s compute allowance + lookup "
        "deadline + two load deadlines + save deadline; the client gives up 30 s later.",
        *(
            [
                "server_frozen: the frozen server's own requests wait out the freeze (within the "
                "request bound); its peer's transfers to and from its segment meet their deadlines."
            ]
            if out.colocated
            else []
        ),
        "Refused in a restart: sent to a server between its kill and "
        f"{judge.RESTART_SLACK_S:.0f} s after it served again (connection refused, or the stream "
        "cut by the kill), or held by a frozen server and cut within as long after it was "
        "continued; refused otherwise: any other HTTP error or refusal (none expected).",
        "Hit rate: vllm:kvpool_lookup_hit_tokens over vllm:kvpool_lookup_query_tokens (tokens "
        "looked up past the local hit), summed over the servers per window. A fault's recovery is "
        "counted from the end of its episode: it, and every fault that began before the rate came "
        "back (the pool cannot heal while another fault holds it down).",
        f"Leaks: per server process generation, from {LEAK_WARMUP_S:.0f} s after it first served, "
        "the median of the first three samples against the last three (API server, engine core "
        "and worker summed): RSS within +25% + 256 MiB, threads +8, fds +32.",
        "Metrics: each server generation that lived to the end finished (vllm:request_success, "
        "length) between the history's completed requests and those plus its hung-up ones; "
        "every failure reason is one of the connector's named ones (other_error, its catch-all "
        "for a code none names, is not); pool outages show as failures.",
        "Negative control: each overwrite replaces the stored blocks (past the system prompt) of "
        "a turn just answered, before its conversation's next turn, sent to the other server, "
        "loads the part its local cache lacks from the pool; blocks loaded: every load of the "
        "phase (vllm:kvpool_transfer_blocks_total, operation load).",
        "slow_link: not injected; this kernel has no sch_netem (`tc qdisc add ... netem` in a "
        "network namespace answers 'Specified qdisc kind is unknown', and no modules can be loaded).",
    ]
    report.notes += [f"fault: {f.kind} at {f.started:.0f} s: {f.error}" for f in failed_injections]
    report.notes += [
        f"wrong: request {r.id} user {r.user} turn {r.turn} on server {r.server}" for r in wrong[:10]
    ]
    data = {
        "workload": asdict(out.workload),
        "shape": asdict(out.shape),
        "bound_s": out.bound_s,
        "injected": injected,
        "wrong": len(wrong),
        "hung": len(fates.hung),
        "failed": len(fates.failed),
        "refused": len(fates.refused),
        "refused_in_restart": len(fates.refused_in_restart),
        "completed": len(fates.completed),
        "disconnected": len(fates.disconnected),
        "control_wrong": len(control_wrong),
        "control_completed": len(control_fates.completed),
        "control_loaded_blocks": control_loaded,
        "leaks": leaks,
        "metrics_disagreements": disagreements,
        "failures": failures,
        "kinds": [asdict(row) for row in kinds],
        "faults": [asdict(f) for f in out.history.faults],
        "timeline": timeline,
    }
    report.data.update(data)
    return report


def _plot(report: Report, out: Outcome, opts: Options) -> None:
    path = common.plot_path(report.name, opts)
    plt = common.pyplot() if path else None
    if plt is None or path is None:
        return
    chaos = out.history.phase("chaos")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
    done = [r for r in chaos.requests if r.outcome == ch.COMPLETED and r.first is not None]
    top.scatter([r.sent for r in done], [r.first - r.sent for r in done], s=6)  # type: ignore[operator]
    refused = [r for r in chaos.requests if r.outcome in (ch.REFUSED, ch.FAILED)]
    ceiling = max((r.first - r.sent for r in done if r.first is not None), default=1.0)
    top.scatter(
        [r.sent for r in refused], [ceiling] * len(refused), s=10, marker="x", color="red", label="refused"
    )
    control = out.history.phase("control").requests
    if control:
        for axis in (top, bottom):
            axis.axvspan(
                min(r.sent for r in control),
                max(r.ended or r.sent for r in control),
                color="grey",
                alpha=0.15,
                label="negative control" if axis is top else None,
            )
    top.set_yscale("log")
    top.set_ylabel("TTFT, s (log)")
    timeline = [(t, rate) for t, rate in report.data["timeline"] if rate is not None]
    bottom.plot([t for t, _ in timeline], [rate for _, rate in timeline], drawstyle="steps-pre")
    bottom.set_ylabel("pool hit rate")
    bottom.set_xlabel("seconds since the traffic started")
    colours = plt.get_cmap("tab10")
    for i, kind in enumerate(kinds_of(out.colocated)):
        spans = [f for f in chaos.faults if f.kind == kind.value]
        for j, fault in enumerate(spans):
            end = max(fault.ended or fault.started, fault.started + 1.0)
            for axis in (top, bottom):
                axis.axvspan(
                    fault.started,
                    end,
                    color=colours(i),
                    alpha=0.25,
                    label=kind.value if j == 0 and axis is top else None,
                )
    handles, labels = top.get_legend_handles_labels()
    top.set_title(
        "TTFT of completed requests (refused ones as x at the top) and the fleet's pool hit rate; "
        "faults shaded",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    report.plots.append(str(path.relative_to(common.BENCH_DIR)))


def main(argv: list[str] | None = None, *, colocated: bool = False) -> int:
    """Run, judge, print the report; exit 1 when a target is not met."""
    parser = common.parser((__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--colocated", action="store_true", default=colocated, help="servers hold the pool; no store process"
    )
    parser.add_argument("--seed", type=int, default=33)
    parser.add_argument("--out", type=Path, default=None, help="folder for history.jsonl and judgement.json")
    parser.add_argument("--judge", type=Path, default=None, help="judge the run kept in this folder again")
    args = parser.parse_args(argv)
    opts = Options(smoke=args.smoke, reps=None, write=args.write and not args.smoke)
    shape = SHORT if opts.smoke else FULL
    started = time.perf_counter()
    if args.judge is not None:  # a kept run, judged again (its report written, with --write)
        out_dir: Path = args.judge
        outcome = Outcome.load(out_dir)
    else:
        # SIGTERM stops the fleet as Ctrl-C does (a background run ignores SIGINT).
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        out_dir = args.out or Path(tempfile.mkdtemp(prefix="kvpool-chaos-"))
        out_dir.mkdir(parents=True, exist_ok=True)
        outcome = run_fleet(shape, Workload(seed=args.seed), args.seed, out_dir, colocated=args.colocated)
        outcome.wall_seconds = round(time.perf_counter() - started, 1)
        outcome.save(out_dir)
    report = judge_outcome(outcome)
    module = "benchmarks.chaos_colocated" if outcome.colocated else "benchmarks.chaos"
    report.command = common.command_line(module, opts) + (f" --seed {args.seed}" if args.seed != 33 else "")
    report.data["wall_seconds"] = outcome.wall_seconds or round(time.perf_counter() - started, 1)
    _plot(report, outcome, opts)
    (out_dir / "judgement.json").write_text(json.dumps(report.data, indent=1, default=str) + "\n")
    print(report.text(), flush=True)
    print(
        f"\n({module}: {report.data['wall_seconds']} s; history in {out_dir / 'history.jsonl'})",
        flush=True,
    )
    if opts.write:
        report.write()
    return 0 if all(t.met is not False for t in report.targets) else 1


if __name__ == "__main__":
    sys.exit(main())
