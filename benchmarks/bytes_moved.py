"""Bytes moved: a sliding-window group's load vs the minimum its hit needs, and vs loading unmasked.

A real vLLM ``Scheduler`` with KVPoolConnector (full attention + sliding window
of W tokens) looks up a prompt whose P-token prefix (P ≫ W) the pool holds in
both groups, and plans the load; the connector's ``WorkerSide`` runs it on real
tensors (full: 2 layers, sliding window: 4 layers, as Gemma3's 1:2 mix). The
minimum is every full-attention block of the hit plus the ``ceil((W-1)/block)``
window blocks before its end. "Unmasked" is the same load with every
sliding-window block of the hit, what a connector without load masks moves.

Replicated KV: two ``WorkerSide`` ranks of a TP=2 layout whose one KV head both
ranks hold (a one-KV-head model; MLA alike) save the same blocks once as one
object per shard (what the connector does) and once as one object per rank; the
objects in the pool and the bytes the ranks stored are counted.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common, pool
from benchmarks.common import Options, Report, Stat, Table, Target, ratios, rotate, stopwatch
from benchmarks.vllm_env import bench_scheduler, ours_transfer, tiny_long_model
from testing.engine import scheduler_of
from testing.kv_cache import GroupDesc
from testing.scheduler import admit, make_request
from testing.worker import run_loads

PREFIXES = (1024, 2048, 4096, 8192, 16384)
SMOKE_PREFIXES = (512,)
WINDOW = 512
SMOKE_WINDOW = 128
BLOCK = 32
LAYERS = (2, 4)  # full, sliding window
SHAPE_TAIL = (BLOCK, 2, 64)  # tokens, KV heads, head size (bf16)
REPLICATED_BLOCKS = 64
SMOKE_REPLICATED_BLOCKS = 4
REPLICATED_SHAPE_TAIL = (BLOCK, 1, 64)  # one KV head per rank: both TP=2 ranks hold it


def _wait_loaded(worker: Any, req_id: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, failed = worker.transfer_results()
        if req_id in failed:
            raise RuntimeError(f"load of {req_id} failed")
        if req_id in done:
            return
        time.sleep(0.002)
    raise TimeoutError(f"load of {req_id} never finished")


def _measure(address: str, model: Path, prefix: int, window: int, reps: int) -> dict[str, Any]:
    import torch

    from kvpool.connector.contract.keys import hash_digest
    from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestLoad, RequestSave
    from kvpool.connector.observability.records import StatsCollector
    from kvpool.connector.worker.side import WorkerSide

    groups = [GroupDesc("full", BLOCK), GroupDesc("sliding_window", BLOCK, window=window)]
    hit_blocks = prefix // BLOCK
    num_blocks = 2 * hit_blocks + 16
    scheduler = bench_scheduler(
        model,
        groups,
        ours_transfer(address, f"bytes{prefix}"),
        num_blocks=num_blocks,
        max_model_len=prefix + 64,
        max_num_batched_tokens=prefix + 64,
    )
    client = pool.client(address, f"bytes{prefix}")
    gen = torch.Generator().manual_seed(prefix)
    caches = {
        f"g{g}.{i}": torch.randn((2, num_blocks, *SHAPE_TAIL), generator=gen).to(torch.bfloat16)
        for g, n in enumerate(LAYERS)
        for i in range(n)
    }
    worker = WorkerSide(
        client=client,
        keyspace=scheduler.connector.keyspace,
        tp_rank=0,
        pp_rank=0,
        group_layers=[[f"g{g}.{i}" for i in range(n)] for g, n in enumerate(LAYERS)],
        num_blocks=num_blocks,
        stats=StatsCollector(group_kinds=("full", "sliding_window")),
    )
    try:
        worker.register_kv_caches(caches)
        block_bytes = [worker.group_block_bytes(g) for g in range(2)]
        rng = random.Random(prefix)
        prompt = [rng.randrange(3, 500) for _ in range(prefix + 16)]
        coord = scheduler_of(scheduler.connector).coordinator

        # The pool holds every block of the prefix in both groups (saved through the worker).
        seed = make_request(scheduler, prompt)
        digests = [
            [hash_digest(bytes(h)) for h in list(coord.group_block_hashes(g, seed.block_hashes))[:hit_blocks]]
            for g in range(2)
        ]
        ids = list(range(1, hit_blocks + 1))
        worker.start_saves(
            PoolConnectorMetadata(
                saves=[RequestSave("seed", [GroupTransfer(g, digests[g], ids) for g in range(2)])]
            )
        )
        worker.before_forward()
        worker.wait_for_saves()
        worker.stats.drain()

        # The scheduler plans the load; the worker runs it as vLLM would (asynchronously).
        request = make_request(scheduler, prompt)
        scheduler.add_request(request)
        output = admit(scheduler)  # its lookup is answered a step after its first call
        (load,) = [x for x in output.kv_connector_metadata.loads if x.req_id == request.request_id]
        worker.start_loads(output.kv_connector_metadata)
        _wait_loaded(worker, request.request_id)
        _, records = worker.stats.drain()
        (record,) = [r for r in records if r.operation == "load"]

        unmasked = RequestLoad(
            "unmasked",
            [load.groups[0], GroupTransfer(1, list(digests[1]), list(load.groups[0].block_ids))],
            hit_tokens=load.hit_tokens,
        )
        masked = RequestLoad("masked", list(load.groups), hit_tokens=load.hit_tokens)
        variants = {"masked": masked, "unmasked": unmasked}
        moved: dict[str, int] = {}
        seconds: dict[str, list[float]] = {v: [] for v in variants}
        for v, plan in variants.items():  # warm-up; bytes
            run_loads(worker, [plan])
            _, recs = worker.stats.drain()
            moved[v] = sum(recs[0].bytes)
        for rep in range(reps):
            for v in rotate(list(variants), rep):
                with stopwatch() as t:
                    run_loads(worker, [variants[v]])
                seconds[v].append(t[0])
        if worker.take_load_errors():
            raise RuntimeError("loads reported errors")
        worker.stats.drain()

        window_blocks = min(hit_blocks, -(-(window - 1) // BLOCK))
        minimum = hit_blocks * block_bytes[0] + window_blocks * block_bytes[1]
        return {
            "prefix": prefix,
            "window": window,
            "hit_tokens": load.hit_tokens,
            "blocks": list(record.blocks),
            "masked_blocks": list(record.masked),
            "bytes_engine_path": sum(record.bytes),
            "bytes_masked": moved["masked"],
            "bytes_unmasked": moved["unmasked"],
            "bytes_min": minimum,
            "block_bytes": block_bytes,
            "seconds": seconds,
        }
    finally:
        worker.shutdown()
        client.close()
        scheduler.shutdown()


def _measure_replicated(address: str, blocks: int) -> list[dict[str, Any]]:
    """Objects and bytes stored for ``blocks`` blocks by two TP ranks holding copies of one KV head."""
    import torch

    from kvpool.connector.contract.keys import KeySpace
    from kvpool.connector.contract.layout import GroupKind, KVGroup, KVLayout
    from kvpool.connector.contract.shards import group_shards
    from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestSave
    from kvpool.connector.observability.records import StatsCollector
    from kvpool.connector.worker.side import WorkerSide

    cache = torch.randn((2, blocks + 1, *REPLICATED_SHAPE_TAIL)).to(torch.bfloat16)
    layers = [f"l{i}" for i in range(LAYERS[0])]
    digests = [f"{i:032x}" for i in range(blocks)]
    rows = []
    for storage, kv_shards in (("one object per rank", None), ("one object per shard", 1)):
        layout = KVLayout(
            groups=[KVGroup(kind=GroupKind.FULL, block_size=BLOCK)], tp_size=2, kv_shards=kv_shards
        )
        keyspace = KeySpace(f"replicated{kv_shards}", "0" * 16)
        client = pool.client(address, keyspace.cache_prefix)
        ranks = [
            WorkerSide(
                client=client,
                keyspace=keyspace,
                tp_rank=rank,
                pp_rank=0,
                group_layers=[layers],
                num_blocks=blocks + 1,
                stats=StatsCollector(group_kinds=("full",)),
                tp_size=2,
                group_shards=group_shards(layout),
            )
            for rank in range(2)
        ]
        try:
            stored = 0
            for worker in ranks:
                worker.register_kv_caches({name: cache.clone() for name in layers})
                save = RequestSave("seed", [GroupTransfer(0, digests, list(range(1, blocks + 1)))])
                worker.start_saves(PoolConnectorMetadata(saves=[save]))
                worker.before_forward()
                worker.wait_for_saves()
                stored += sum(sum(r.bytes) for r in worker.stats.drain()[1] if r.operation == "save")
            keys = [keyspace.key(0, shard, 0, d) for shard in range(2) for d in digests]
            rows.append(
                {
                    "storage": storage,
                    "objects_per_block": sum(client.exists(keys)) / blocks,
                    "bytes_per_block": stored / blocks,
                    "rank_block_bytes": ranks[0].group_block_bytes(0),
                }
            )
        finally:
            for worker in ranks:
                worker.shutdown()
            client.close()
    return rows


def run(opts: Options) -> Report:
    from kvpool.connector.local.pool import LocalPool

    reps = opts.repetitions(7)
    prefixes = SMOKE_PREFIXES if opts.smoke else PREFIXES
    window = SMOKE_WINDOW if opts.smoke else WINDOW
    model = tiny_long_model()
    rows = []
    with LocalPool(segment_size="512MB") as lp:
        for prefix in prefixes:
            rows.append(_measure(lp.address, model, prefix, window, reps))
            print(f"  prefix {prefix}: done", file=sys.stderr, flush=True)
        replicated = _measure_replicated(
            lp.address, SMOKE_REPLICATED_BLOCKS if opts.smoke else REPLICATED_BLOCKS
        )
    report = _report(rows, reps, opts)
    _report_replicated(report, replicated)
    return report


def _kib(n: float) -> str:
    return f"{n / 2**10:.0f} KiB"


def _report_replicated(report: Report, rows: list[dict[str, Any]]) -> None:
    from kvpool.connector.contract.shards import kv_shards_of

    per_rank, per_shard = rows
    table = Table(
        "stored per block by a TP=2 engine whose ranks hold copies of one KV head (measured: two "
        "ranks' saves on the real pool); larger TP computed from the same shard split",
        ["TP", "KV heads", "storage", "objects per block", "bytes per block", "vs one per rank"],
    )
    for r in rows:
        ratio = r["bytes_per_block"] / per_rank["bytes_per_block"]
        table.add(
            2, 1, r["storage"], f"{r['objects_per_block']:g}", _kib(r["bytes_per_block"]), f"{ratio:.2f}"
        )
    for tp, heads, mla in ((8, 1, False), (8, 2, False), (8, "MLA", True)):
        shards = kv_shards_of(tp, 1 if mla else int(heads), mla)
        bytes_text = f"{shards}x a rank's block"
        table.add(tp, heads, "one object per shard (computed)", shards, bytes_text, f"{shards}/{tp}")
    report.tables.append(table)
    saved = 1 - per_shard["bytes_per_block"] / per_rank["bytes_per_block"]
    exact = per_shard["objects_per_block"] == 1 and per_rank["objects_per_block"] == 2
    report.targets.append(
        Target(
            "replicated KV stored once per shard (TP=2, one KV head)",
            f"{saved:.0%} fewer bytes stored",
            exact,
        )
    )
    report.notes.append(
        "Replicated KV: each rank's block is one KV head (the same bytes on both ranks); stored once "
        f"per shard, a TP=2 engine stores {saved:.0%} fewer bytes and half the objects, and a TP=N "
        "engine 1/N of them when every rank holds the same KV. Loads are unchanged: every rank reads "
        "its shard's object."
    )
    report.data["replicated"] = rows


def _report(rows: list[dict[str, Any]], reps: int, opts: Options) -> Report:
    report = Report("bytes_moved", "3. Bytes moved: sliding-window load mask vs minimum vs unmasked", "")
    table = Table(
        f"one load of the hit; time: ms, median (min..max) of {reps}; ratios paired per repetition",
        [
            "P tokens",
            "W",
            "hit",
            "blocks loaded full/SW",
            "SW masked",
            "minimum",
            "moved (masked)",
            "moved/min",
            "unmasked",
            "unmasked/moved",
            "masked ms",
            "unmasked ms",
            "time masked/unmasked",
        ],
    )
    exact = True
    for r in rows:
        exact &= r["bytes_masked"] == r["bytes_min"] == r["bytes_engine_path"]
        s = {v: Stat.of(r["seconds"][v]) for v in ("masked", "unmasked")}
        table.add(
            r["prefix"],
            r["window"],
            r["hit_tokens"],
            "/".join(map(str, r["blocks"])),
            r["masked_blocks"][1],
            common.mib(r["bytes_min"]),
            common.mib(r["bytes_masked"]),
            f"{r['bytes_masked'] / r['bytes_min']:.2f}",
            common.mib(r["bytes_unmasked"]),
            f"{r['bytes_unmasked'] / r['bytes_masked']:.2f}x",
            s["masked"].fmt(1e3),
            s["unmasked"].fmt(1e3),
            ratios(r["seconds"]["masked"], r["seconds"]["unmasked"]).ratio(),
        )
    report.tables.append(table)
    worst = max(r["bytes_masked"] / r["bytes_min"] for r in rows)
    report.targets.append(Target("bytes loaded / minimum = 1.00", f"worst {worst:.2f}", exact))
    report.notes.append(
        "'moved (masked)' is what the connector's worker loaded for the scheduler's plan, as vLLM runs it "
        "(asynchronously); the timed loads replay the same plan synchronously."
    )
    report.data["rows"] = rows
    path = common.plot_path("bytes_moved", opts)
    if path is not None and _plot(rows, path):
        report.plots.append(str(path.relative_to(common.BENCH_DIR)))
    return report


def _plot(rows: list[dict[str, Any]], path: Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    xs = [r["prefix"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(xs, [r["bytes_unmasked"] / 2**20 for r in rows], "o-", color="tab:red", label="unmasked")
    left.plot(
        xs, [r["bytes_masked"] / 2**20 for r in rows], "o-", color="tab:blue", label="connector (masked)"
    )
    left.plot(xs, [r["bytes_min"] / 2**20 for r in rows], "x--", color="black", label="minimum")
    sw_only = [r["block_bytes"][1] * r["blocks"][1] / 2**20 for r in rows]
    left.plot(xs, sw_only, "s:", color="tab:green", label="of which sliding window (masked)")
    left.set_xlabel(f"prefix tokens P (window W = {rows[0]['window']})")
    left.set_ylabel("MiB loaded")
    left.set_xscale("log", base=2)
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    for v, color in (("unmasked", "tab:red"), ("masked", "tab:blue")):
        stats = [Stat.of(r["seconds"][v]) for r in rows]
        right.errorbar(
            xs,
            [s.median * 1e3 for s in stats],
            yerr=[[(s.median - s.low) * 1e3 for s in stats], [(s.high - s.median) * 1e3 for s in stats]],
            marker="o",
            capsize=3,
            color=color,
            label=v,
        )
    right.set_xlabel("prefix tokens P")
    right.set_ylabel("load ms (median, min..max)")
    right.set_xscale("log", base=2)
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(common.main("benchmarks.bytes_moved", __doc__, run))
