"""Lookup: scheduler-side ``get_num_new_matched_tokens``, ours vs vLLM's in-tree MooncakeStoreConnector.

Both connectors sit in real vLLM ``Scheduler`` objects on the same Mooncake
master, which holds the same blocks (full, half or none of each prompt's
blocks, in every group) under each connector's own keys. Ours asks the master
itself; the in-tree one sends each lookup over ZMQ to the ``LookupKeyServer``
of its rank-0 worker, measured with that worker in the scheduler's process (as
vLLM's ``UniProcExecutor`` runs it) and in a process of its own (as
``MultiprocExecutor`` does). Every variant must return the same hit length.

Ours is asked and waited for (``testing.scheduler.matched_tokens``): its first
call queues the lookup, the presence service's thread answers it, and a second
call takes the hit, all timed as one call. That is what one request costs when it
is alone in its step (in an engine the first call returns ``None`` at once and the
hit comes a step later; ``benchmarks.scheduler_overhead`` measures that).
"""

from __future__ import annotations

import gc
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import common, intree, pool
from benchmarks.common import Options, Report, Stat, Table, Target, ratios, rotate, stopwatch
from benchmarks.vllm_env import bench_scheduler, ours_transfer, tiny_long_model
from testing.engine import scheduler_of
from testing.kv_cache import GroupDesc
from testing.pool_store import raw_store
from testing.scheduler import PresenceMeter, make_request, matched_tokens, settle

LENGTHS = (1024, 8192, 32768)
SMOKE_LENGTHS = (1024,)
WINDOW = 512
LAYOUTS: dict[str, list[GroupDesc]] = {
    "2 groups (full + SW)": [GroupDesc("full"), GroupDesc("sliding_window", window=WINDOW)],
    "3 groups (full + SW + mamba)": [
        GroupDesc("full"),
        GroupDesc("sliding_window", window=WINDOW),
        GroupDesc("mamba"),
    ],
}
SCENARIOS = ("full", "partial", "none")
NUM_BLOCKS = 4096
TARGET_TOKENS = 8192  # the lookup-time target is stated for 8k and 32k tokens
VARIANTS = ("ours", "intree_thread", "intree_process")
TOTAL = "get_num_new_matched_tokens (total)"
LABELS = {
    "ours": "ours",
    "intree_thread": "in-tree (server thread in-process)",
    "intree_process": "in-tree (server in worker process)",
}


def _ours_keys(scheduler: Any, request: Any, counts: list[int]) -> list[str]:
    from kvpool.connector.contract.keys import hash_digest

    connector = scheduler.connector
    coord = scheduler_of(connector).coordinator
    keys = []
    for g, count in enumerate(counts):
        view = coord.group_block_hashes(g, request.block_hashes)
        keys += [connector.keyspace.key(g, 0, 0, hash_digest(bytes(view[i]))) for i in range(count)]
    return keys


def _ours_key_count(scheduler: Any) -> int:
    """Keys our last lookup asked the master about (it asks only what its fixed point reads)."""
    return scheduler.connector.stats.lookups[-1].keys


def _intree_key_count(worker_connector: Any, request: Any) -> int:
    """Keys the in-tree ``MooncakeStoreWorker.lookup`` asks the master about (its lookup masks)."""
    from vllm.utils.math_utils import cdiv

    worker = worker_connector.connector_worker
    token_len = worker.coord.align_lookup_length(request.num_tokens)
    masks = worker.coord.lookup_mask(token_len)
    total = 0
    for g, db in enumerate(worker.token_dbs):
        hashes = worker.coord.block_hashes_for_spec(
            request.block_hashes, worker._kv_cache_groups[g].kv_cache_spec
        )
        limit = min(len(hashes), cdiv(token_len, db.block_size))
        mask = masks[g]
        chunks = limit if mask is None else sum(1 for i in range(min(limit, len(mask))) if mask[i])
        total += chunks * len(worker._lookup_key_prefixes[g])
    return total


def _asker(scheduler: Any) -> Any:
    """A call of ``scheduler``'s lookup for a request, returning the hit (ours: asked and
    waited for, see the module docstring)."""
    from kvpool.connector.connector import KVPoolConnector

    connector = scheduler.connector
    if isinstance(connector, KVPoolConnector):
        return lambda request: matched_tokens(connector, request)[0]
    return lambda request: connector.get_num_new_matched_tokens(request, 0)[0]


def _diagnose(scheduler: Any, request: Any, reps: int) -> dict[str, list[float]]:
    """Time the parts of our lookup that can be called alone; the rest is derived in the report."""
    from kvpool.connector.contract.keys import hash_digest

    connector = scheduler.connector
    side = scheduler_of(connector)
    coord, keyspace, client = side.coordinator, connector.keyspace, side.client
    max_hit = request.num_tokens - 1
    hashes = request.block_hashes
    wanted = coord.lookup_blocks(hashes, max_hit)
    keys = [keyspace.key(g, 0, 0, hash_digest(h)) for g, blocks in wanted.items() for h in blocks]
    ask = _asker(scheduler)
    ask(request)
    _settle(scheduler, request)
    asked = keys[: side.stats.lookups[-1].keys]  # as many keys as it asks; the pool holds none

    def absent(questions: Any) -> dict[int, list[bool]]:
        return {g: [False] * len(indices) for g, indices in questions.items()}

    parts = {
        TOTAL: lambda: ask(request),
        "lookup_blocks (per-group hash views)": lambda: coord.lookup_blocks(hashes, max_hit),
        f"store.exists ({len(asked)} keys asked)": lambda: client.exists(asked),
        "find_hit_asking (fixed point, answers without I/O)": lambda: coord.find_hit_asking(
            hashes, wanted, max_hit, absent
        ),
        f"for comparison: one batch_is_exist of all {len(keys)} keys a hit may use": lambda: raw_store(
            client
        ).batch_is_exist(keys),
    }
    out: dict[str, list[float]] = {k: [] for k in parts}
    for _ in range(reps):
        for label, fn in parts.items():
            with stopwatch() as t:
                fn()
            out[label].append(t[0])
            _settle(scheduler, request)
    return out


def _settle(scheduler: Any, request: Any) -> None:
    """Untimed, after each of our calls: let the statistics' check (off the lookup's path)
    finish, and forget the request (as vLLM does when it finishes): its lookup would be kept
    until allocated, and the next call looks it up again."""
    from kvpool.connector.connector import KVPoolConnector

    if isinstance(scheduler.connector, KVPoolConnector):
        settle(scheduler.connector, 5.0)
        scheduler_of(scheduler.connector).request_finished(request.request_id)


def freeze_gc_heap() -> None:
    from vllm.utils.gc_utils import freeze_gc_heap as freeze

    freeze()


def _measure_layout(
    name: str,
    groups: list[GroupDesc],
    index: int,
    address: str,
    config_path: Path,
    writer: Any,
    model: Path,
    lengths: tuple[int, ...],
    reps: int,
) -> list[dict[str, Any]]:
    ports = (40000 + 2 * index, 40001 + 2 * index)  # IPC socket names only, not TCP ports
    it_transfer = [intree.intree_transfer(f"intree{index}", port) for port in ports]
    schedulers = {
        "ours": bench_scheduler(model, groups, ours_transfer(address, f"ours{index}"), num_blocks=NUM_BLOCKS),
        "intree_thread": bench_scheduler(model, groups, it_transfer[0], num_blocks=NUM_BLOCKS),
        "intree_process": bench_scheduler(model, groups, it_transfer[1], num_blocks=NUM_BLOCKS),
    }
    # One request's lookup, asked and answered within the call (see the module docstring).
    asks = {v: _asker(s) for v, s in schedulers.items()}
    # Our calls to the master: every existence check of the scheduler side (rounds and statistics).
    meter = PresenceMeter(schedulers["ours"].connector)
    worker = intree.start_worker(model, groups, it_transfer[0], NUM_BLOCKS, config_path)
    rows: list[dict[str, Any]] = []
    rng = random.Random(1000 + index)
    try:
        with intree.WorkerProcess(model, groups, it_transfer[1], NUM_BLOCKS, config_path):
            for length in lengths:
                for scenario in SCENARIOS:
                    prompt = [rng.randrange(3, 500) for _ in range(length)]
                    requests = {v: make_request(schedulers[v], prompt) for v in VARIANTS}
                    num_hashes = len(requests["ours"].block_hashes)
                    held = {"full": num_hashes, "partial": num_hashes // 2, "none": 0}[scenario]
                    counts = [held] * len(groups)
                    if held:
                        pool.put_markers(writer, _ours_keys(schedulers["ours"], requests["ours"], counts))
                        pool.put_markers(
                            writer, intree.intree_keys(worker, requests["ours"].block_hashes, counts)
                        )
                    freeze_gc_heap()  # as vLLM's EngineCore does after start-up
                    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
                    hits: dict[str, set[int]] = {v: set() for v in VARIANTS}
                    checks: list[int] = []  # ours, per call, its statistics' included (settled)
                    for v in VARIANTS:  # warm-up, untimed
                        hits[v].add(int(asks[v](requests[v]) or 0))
                        _settle(schedulers[v], requests[v])
                    for rep in range(reps):
                        for v in rotate(VARIANTS, rep):
                            before = meter.checks
                            with stopwatch() as t:
                                got = asks[v](requests[v])
                            times[v].append(t[0])
                            hits[v].add(int(got or 0))
                            _settle(schedulers[v], requests[v])
                            if v == "ours":
                                checks.append(meter.checks - before)
                    rows.append(
                        {
                            "layout": name,
                            "groups": len(groups),
                            "tokens": length,
                            "pool": scenario,
                            "hits": {v: sorted(h) for v, h in hits.items()},
                            "keys_ours": _ours_key_count(schedulers["ours"]),
                            "keys_intree": _intree_key_count(worker, requests["ours"]),
                            "checks_ours": checks,
                            "seconds": times,
                        }
                    )
                    if length == max(lengths) and scenario == "none":
                        rows[-1]["diagnosis"] = _diagnose(schedulers["ours"], requests["ours"], reps)
                    print(f"  {name} {length} tokens, pool {scenario}: done", file=sys.stderr, flush=True)
    finally:
        worker.shutdown()
        for s in schedulers.values():
            s.shutdown()
    return rows


def run(opts: Options) -> Report:
    reps = opts.repetitions(15)
    lengths = SMOKE_LENGTHS if opts.smoke else LENGTHS
    layouts = list(LAYOUTS.items())[:1] if opts.smoke else list(LAYOUTS.items())
    from kvpool.connector.local.pool import LocalPool

    model = tiny_long_model()
    rows: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="kvpool-bench-lookup-") as tmp,
        LocalPool(segment_size="256MB") as lp,
    ):
        config_path = intree.write_mooncake_config(Path(tmp) / "mc.json", lp.address)
        os.environ["VLLM_RPC_BASE_PATH"] = tmp
        writer = pool.client(lp.address)
        try:
            for index, (name, groups) in enumerate(layouts):
                rows += _measure_layout(
                    name, groups, index, lp.address, config_path, writer, model, lengths, reps
                )
        finally:
            gc.unfreeze()
            writer.close()
            intree.teardown_single_rank()
    return _report(rows, reps, opts)


def _report(rows: list[dict[str, Any]], reps: int, opts: Options) -> Report:
    report = Report("lookup", "1. Lookup: get_num_new_matched_tokens, ours vs vLLM in-tree", "")
    table = Table(
        f"lookup time per request, ms: median (min..max) of {reps}; "
        "ratio = ours / in-tree, paired per repetition",
        [
            "layout",
            "tokens",
            "pool holds",
            "hit",
            "keys ours/in-tree",
            "master calls ours",
            "ours ms",
            "in-tree ms (thread)",
            "ratio",
            "in-tree ms (process)",
            "ratio",
        ],
    )
    all_equal = True
    worst = 0.0  # the stated target's rows: 8k tokens and more
    worst_short = 0.0
    for r in rows:
        hit_sets = list(r["hits"].values())
        equal = all(h == hit_sets[0] for h in hit_sets) and len(hit_sets[0]) == 1
        all_equal &= equal
        hit = str(hit_sets[0][0]) if equal else "MISMATCH " + str(r["hits"])
        s = {v: Stat.of(r["seconds"][v]) for v in VARIANTS}
        ratio_t = ratios(r["seconds"]["ours"], r["seconds"]["intree_thread"])
        ratio_p = ratios(r["seconds"]["ours"], r["seconds"]["intree_process"])
        if r["tokens"] >= TARGET_TOKENS:
            worst = max(worst, ratio_t.median, ratio_p.median)
        else:
            worst_short = max(worst_short, ratio_t.median, ratio_p.median)
        r["ratio_thread"], r["ratio_process"] = ratio_t.median, ratio_p.median
        table.add(
            r["layout"].split(" (")[0],
            r["tokens"],
            r["pool"],
            hit,
            f"{r['keys_ours']}/{r['keys_intree']}",
            "/".join(str(c) for c in sorted(set(r["checks_ours"]))),
            s["ours"].fmt(1e3),
            s["intree_thread"].fmt(1e3),
            ratio_t.ratio(),
            s["intree_process"].fmt(1e3),
            ratio_p.ratio(),
        )
    report.tables.append(table)
    diagnosed = [r for r in rows if "diagnosis" in r]
    if diagnosed:
        r = diagnosed[-1]
        total = Stat.of(r["diagnosis"][TOTAL]).median
        parts = Table(
            f"where our lookup spends its time: {r['layout']}, {r['tokens']} tokens, pool holds none; "
            f"ms, median (min..max) of {reps}",
            ["part", "ms", "share of total"],
        )
        named = 0.0
        for label, values in r["diagnosis"].items():
            st = Stat.of(values)
            if label != TOTAL and not label.startswith("for comparison"):
                named += st.median
            parts.add(label, st.fmt(1e3), f"{st.median / total * 100:.0f}%")
        rest = total - named
        parts.add(
            "the rest: the hand-off to the presence thread and back, digests, key strings, "
            "presence by position, stats record",
            f"{rest * 1e3:.2f}",
            f"{rest / total * 100:.0f}%",
        )
        report.tables.append(parts)
    report.targets.append(
        Target("same hit lengths as in-tree", "equal in every case" if all_equal else "MISMATCH", all_equal)
    )
    report.targets.append(
        Target(
            "≤ 0.5x in-tree lookup time (8k and 32k tokens)", f"worst median ratio {worst:.2f}x", worst <= 0.5
        )
    )
    if worst_short:
        report.targets.append(
            Target("(1k tokens, not a stated target)", f"worst median ratio {worst_short:.2f}x", None)
        )
    report.notes.append(
        "Both connectors run inside real vLLM Scheduler objects against one Mooncake master on loopback; "
        "pool values are 16-byte markers (a lookup only asks whether keys exist)."
    )
    report.notes.append(
        "'keys ours' are the keys our lookup asked about: every full-attention block up to the "
        "longest possible hit and each other group's blocks at a candidate hit's end (a second, "
        "small round trip when the hit is shorter), or every block of every group when that is at "
        "most ASK_AHEAD_KEYS (256) keys more: then one round trip; in-tree asks about every block "
        "of every group. Our per-group statistics ask about the other blocks, if any, on the presence "
        "service's thread after the lookup is answered; each call waits for that (untimed) before "
        "the next variant runs. 'master calls ours': existence checks per call (the lookup's rounds "
        "and the statistics' check), the values seen over the repetitions."
    )
    report.data["rows"] = rows
    path = common.plot_path("lookup", opts)
    if path is not None and _plot(rows, path):
        report.plots.append(str(path.relative_to(common.BENCH_DIR)))
    return report


def _plot(rows: list[dict[str, Any]], path: Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    layouts = sorted({r["layout"] for r in rows})
    fig, axes = plt.subplots(1, len(layouts), figsize=(6 * len(layouts), 4.2), squeeze=False)
    for ax, layout in zip(axes[0], layouts):
        for scenario, style in (("full", "-"), ("none", ":")):
            sel = sorted(
                (r for r in rows if r["layout"] == layout and r["pool"] == scenario),
                key=lambda r: r["tokens"],
            )
            xs = [r["tokens"] for r in sel]
            for v, color in (
                ("ours", "tab:blue"),
                ("intree_thread", "tab:orange"),
                ("intree_process", "tab:green"),
            ):
                ys = [Stat.of(r["seconds"][v]).median * 1e3 for r in sel]
                ax.plot(xs, ys, style, marker="o", color=color, label=f"{LABELS[v]}, pool {scenario}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("lookup ms (median)")
        ax.set_title(layout)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(common.main("benchmarks.lookup", __doc__, run))
