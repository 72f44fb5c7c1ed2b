"""Transfer: load and save of N blocks per group, connector worker vs raw Mooncake vs memcpy.

One ``WorkerSide`` (the connector's worker half) with vLLM-shaped KV tensors
(``(2, blocks, 32 tokens, 4 heads, 128)`` bf16 per layer, two groups of six
layers sharing each layer tensor as vLLM's hybrid allocator does) registered
with a Mooncake client. The same blocks move three ways:

* **connector** — ``start_loads`` (until the load is reported) / ``start_saves`` + the
  ``before_forward`` barrier, exactly what vLLM calls, then ``wait_for_saves``
  (until the objects are published);
* **raw** — ``batch_get_into_multi_buffers`` / ``batch_put_from_multi_buffers``
  on the same registered buffers and scatter lists, one call per group (the
  connector's batching for N ≤ its ``batch_size``; one call for both groups
  stalls for 60 s above ~2048 scatter entries on Mooncake's TCP transport);
* **memcpy** — ``memmove`` of the same regions from/to a staging buffer in this process.

The connector moves each block as one object (its 64-byte header, then the block)
through a registered staging buffer per transfer thread; raw moves the bare block
with one scatter entry per K and V run. The header's own cost per block (the
payload's checksum, packing and writing the header for a save; reading and checking
both for a load; its bytes) is measured apart and set against the connector's
run-to-run spread, on the CPU path (CRC-32C) and on the device path run on CPU tensors
(``WORD_SUMS`` with torch operations: its cost here is not a GPU's, its bytes are). The load's read-ahead
(the next batch read into one half of the staging buffer while the other half is checked
and copied into the blocks, which the connector does when its client holds a segment of
the pool) is set against batches four times larger and against one read a group, paired,
at the largest size, in both placements.

Saves write fresh keys every repetition (a second put of a key is a no-op), removed afterwards.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import common, pool
from benchmarks.common import Options, Report, Stat, Table, Target, ratios, rotate, stopwatch
from testing.pool_store import put_placement, raw_store
from testing.worker import run_loads, staging_slot

SIZES = (8, 32, 128)
SMOKE_SIZES = (4,)
LAYERS_PER_GROUP = 6
SHAPE_TAIL = (32, 4, 128)  # tokens per block, KV heads, head size
VARIANTS = ("connector", "raw", "memcpy")
REMOTE = "remote"  # the objects in the store process, across loopback TCP
CO_LOCATED = "co-located"  # the client's own segment (embedded pools): Mooncake copies locally
CO_LOCATED_SEGMENT = 1 << 30
#: Issue #32 retired the memcpy targets: why, in the summary's verdict.
RETIRED_REMOTE = (
    "issue #32: raw Mooncake over loopback TCP reaches ~0.09x memcpy here; the bound stands as ≥ 0.9x raw"
)
RETIRED_CO_LOCATED = "issue #32: replaced by what a user feels, 4. hit TTFT ≤ 1.25x the local-hit floor"


@dataclass
class Rig:
    """The worker, its tensors and the raw store handle on the same client."""

    worker: Any
    client: Any
    caches: dict[str, Any]
    num_blocks: int
    staging: Any

    @property
    def store(self) -> Any:
        return raw_store(self.client)

    def scatter(self, group: int, block_ids: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        ptrs, sizes = [], []
        for b in block_ids:
            p, s = self.worker.memory_runs(group, b)
            ptrs.append(p)
            sizes.append(s)
        return ptrs, sizes

    @property
    def placement(self) -> tuple[Any, ...]:
        """Raw puts place objects where the connector's saves go (its own segment, if any)."""
        return put_placement(self.client)

    def keys(self, group: int, digests: list[str]) -> list[str]:
        return [self.worker.keyspace.key(group, 0, 0, d) for d in digests]


def _make_rig(address: str, max_n: int, segment: int = 0) -> Rig:
    """The rig on a client contributing ``segment`` bytes (0: the store process holds every object)."""
    import torch

    from kvpool.connector.contract.keys import KeySpace
    from kvpool.connector.observability.records import StatsCollector
    from kvpool.connector.pool_client import open_client
    from kvpool.connector.worker.side import WorkerSide, read_ahead_bytes

    num_blocks = 4 * max_n + 1  # sources and destinations of both groups, plus block 0
    client = open_client(pool.settings(address, "xfer"), global_segment_size=segment)
    gen = torch.Generator().manual_seed(0)
    caches: dict[str, Any] = {}
    for i in range(LAYERS_PER_GROUP):
        tensor = torch.randn((2, num_blocks, *SHAPE_TAIL), generator=gen).to(torch.bfloat16)
        caches[f"full.{i}"] = tensor
        caches[f"swa.{i}"] = tensor  # the hybrid allocator shares a tensor across groups
    worker = WorkerSide(
        client=client,
        keyspace=KeySpace("xfer", "bench"),
        tp_rank=0,
        pp_rank=0,
        group_layers=[
            [f"full.{i}" for i in range(LAYERS_PER_GROUP)],
            [f"swa.{i}" for i in range(LAYERS_PER_GROUP)],
        ],
        num_blocks=num_blocks,
        stats=StatsCollector(group_kinds=("full", "sliding_window")),
        load_batch_bytes=read_ahead_bytes(segment),  # as the connector sets it
        direct_local_loads=segment > 0,  # as the connector does by default
    )
    worker.register_kv_caches(caches)
    block_bytes = worker.group_block_bytes(0)
    staging = torch.zeros(2 * max_n * block_bytes, dtype=torch.uint8)
    return Rig(worker, client, caches, num_blocks, staging)


def _memcpy(pairs: list[tuple[int, int, int]]) -> None:
    move = ctypes.memmove
    for dst, src, size in pairs:
        move(dst, src, size)


def _staging_pairs(
    rig: Rig, ptrs: list[list[int]], sizes: list[list[int]], to_staging: bool, offset: int = 0
) -> list[tuple[int, int, int]]:
    base = rig.staging.data_ptr()
    pairs = []
    for block_ptrs, block_sizes in zip(ptrs, sizes):
        for p, s in zip(block_ptrs, block_sizes):
            pairs.append((base + offset, p, s) if to_staging else (p, base + offset, s))
            offset += s
    return pairs


def _measure(rig: Rig, n: int, reps: int) -> dict[str, Any]:
    from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestLoad, RequestSave

    worker, store = rig.worker, rig.store
    src = [list(range(1 + g * n, 1 + (g + 1) * n)) for g in range(2)]
    dst = [list(range(1 + (2 + g) * n, 1 + (3 + g) * n)) for g in range(2)]
    block_bytes = worker.group_block_bytes(0)
    total = 2 * n * block_bytes
    src_lists = [rig.scatter(g, src[g]) for g in range(2)]
    dst_lists = [rig.scatter(g, dst[g]) for g in range(2)]

    # The blocks every load reads, stored once: by the connector (each object starts with
    # its header) and raw (the bare blocks) for the raw loads.
    load_digests = [[f"load-{n}-{g}-{i}" for i in range(n)] for g in range(2)]
    load_keys = [rig.keys(g, load_digests[g]) for g in range(2)]
    seed = [GroupTransfer(g, list(load_digests[g]), list(src[g])) for g in range(2)]
    worker.start_saves(PoolConnectorMetadata(saves=[RequestSave(f"seed-{n}", seed)]))
    worker.before_forward()
    worker.wait_for_saves()
    raw_keys = [[f"rawload/{n}/{g}/{i}" for i in range(n)] for g in range(2)]
    for g in range(2):
        codes = store.batch_put_from_multi_buffers(raw_keys[g], *src_lists[g], *rig.placement)
        if any(c != 0 for c in codes) or not all(rig.client.exists(load_keys[g])):
            raise RuntimeError(f"storing the load set failed: {sorted(set(codes))}")

    def connector_load(rep: int) -> None:
        groups = [GroupTransfer(g, list(load_digests[g]), list(dst[g])) for g in range(2)]
        run_loads(worker, [RequestLoad(f"load-{n}-{rep}", groups, hit_tokens=n * 32)])
        if worker.take_load_errors():
            raise RuntimeError("connector load reported errors")

    def raw_load(rep: int) -> None:
        for g in range(2):
            got = store.batch_get_into_multi_buffers(raw_keys[g], *dst_lists[g])
            if any(c != block_bytes for c in got):
                raise RuntimeError(f"raw load failed: {sorted(set(got))}")

    load_pairs, save_pairs = [], []
    for g in range(2):
        load_pairs += _staging_pairs(rig, *dst_lists[g], to_staging=False, offset=g * n * block_bytes)
        save_pairs += _staging_pairs(rig, *src_lists[g], to_staging=True, offset=g * n * block_bytes)
    fresh: list[str] = []

    def connector_save(rep: int) -> None:
        digests = [[f"save-{n}-{rep}-{g}-{i}" for i in range(n)] for g in range(2)]
        fresh.extend(rig.keys(0, digests[0]) + rig.keys(1, digests[1]))
        groups = [GroupTransfer(g, digests[g], list(src[g])) for g in range(2)]
        worker.start_saves(PoolConnectorMetadata(saves=[RequestSave(f"save-{n}-{rep}", groups)]))
        worker.before_forward()
        worker.wait_for_saves()

    def raw_save(rep: int) -> None:
        for g in range(2):
            keys = [f"rawsave/{n}/{rep}/{g}/{i}" for i in range(n)]
            fresh.extend(keys)
            got = store.batch_put_from_multi_buffers(keys, *src_lists[g], *rig.placement)
            if any(c != 0 for c in got):
                raise RuntimeError(f"raw save failed: {sorted(set(got))}")

    ops = {
        "load": {"connector": connector_load, "raw": raw_load, "memcpy": lambda rep: _memcpy(load_pairs)},
        "save": {"connector": connector_save, "raw": raw_save, "memcpy": lambda rep: _memcpy(save_pairs)},
    }
    # A byte check of the connector's load, then a warm-up of everything (untimed).
    connector_load(-1)
    for g in range(2):
        for name in ("full.0", f"full.{LAYERS_PER_GROUP - 1}"):
            layer = rig.caches[name]
            for s_id, d_id in zip(src[g], dst[g]):
                if not bool((layer[:, s_id] == layer[:, d_id]).all()):
                    raise RuntimeError(f"loaded block {d_id} differs from stored block {s_id}")
    for op in ops.values():
        for fn in op.values():
            fn(-1)
    rig.client.remove(fresh)
    fresh.clear()
    worker.stats.drain()

    seconds: dict[str, dict[str, list[float]]] = {op: {v: [] for v in VARIANTS} for op in ops}
    for rep in range(reps):
        for op, fns in ops.items():
            for v in rotate(VARIANTS, rep):
                with stopwatch() as t:
                    fns[v](rep)
                seconds[op][v].append(t[0])
            if fresh:
                rig.client.remove(fresh)
                fresh.clear()
    _, records = worker.stats.drain()
    moved = {op: {r.operation: sum(r.bytes) for r in records}.get(op) for op in ops}
    for op, nbytes in moved.items():
        if nbytes != total:
            raise RuntimeError(f"connector {op} moved {nbytes} bytes, expected {total}")
    rig.client.remove(load_keys[0] + load_keys[1] + raw_keys[0] + raw_keys[1])
    return {
        "blocks_per_group": n,
        "bytes": total,
        "seconds": seconds,
        "header": _header_cost(rig, n, reps),
        "header_device": _header_cost(rig, n, reps, device_path=True),
    }


# Read-ahead batches compared with the connector's (``LOAD_BATCH_BYTES``): this many times it.
READ_AHEAD_ALTERNATIVE = 4
ONE_READ = "one read a group"
#: A co-located load's variant with no staging at all (issue #32's direct loads).
DIRECT = "direct (no staging)"


def _read_ahead(rig: Rig, n: int, reps: int) -> dict[str, Any]:
    """Seconds of the connector's load of ``n`` blocks per group reading ahead in ``LOAD_BATCH_BYTES``
    batches, in batches ``READ_AHEAD_ALTERNATIVE`` times larger, and with one read a group (no
    overlap), paired; and which of them the placement uses."""
    from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestLoad, RequestSave
    from kvpool.connector.worker import side as worker_side

    worker = rig.worker
    src = [list(range(1 + g * n, 1 + (g + 1) * n)) for g in range(2)]
    dst = [list(range(1 + (2 + g) * n, 1 + (3 + g) * n)) for g in range(2)]
    digests = [[f"ahead-{n}-{g}-{i}" for i in range(n)] for g in range(2)]
    seed = [GroupTransfer(g, list(digests[g]), list(src[g])) for g in range(2)]
    worker.start_saves(PoolConnectorMetadata(saves=[RequestSave(f"ahead-seed-{n}", seed)]))
    worker.before_forward()
    worker.wait_for_saves()
    used, direct = worker.load_batch_bytes, worker.direct_local_loads
    default = worker_side.LOAD_BATCH_BYTES
    larger = READ_AHEAD_ALTERNATIVE * default
    batch_bytes = {common.mib(default): default, common.mib(larger): larger, ONE_READ: None}
    variants = [*batch_bytes, *([DIRECT] if direct else [])]
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    try:
        for rep in range(-1, reps):  # -1: warm-up, untimed
            for variant in rotate(variants, max(rep, 0)):
                worker.direct_local_loads = variant == DIRECT
                worker.load_batch_bytes = batch_bytes.get(variant, used)
                groups = [GroupTransfer(g, list(digests[g]), list(dst[g])) for g in range(2)]
                request = RequestLoad(f"ahead-{n}-{rep}-{variant}", groups, hit_tokens=n * 32)
                with stopwatch() as t:
                    run_loads(worker, [request])
                if worker.take_load_errors():
                    raise RuntimeError(f"connector load ({variant}) reported errors")
                if rep >= 0:
                    seconds[variant].append(t[0])
    finally:
        worker.load_batch_bytes, worker.direct_local_loads = used, direct
    rig.client.remove(rig.keys(0, digests[0]) + rig.keys(1, digests[1]))
    _, records = worker.stats.drain()
    if direct and not any(r.direct_blocks for r in records if r.operation == "load"):
        raise RuntimeError("no co-located load was direct: the objects are not in the client's segment")
    return {
        "blocks_per_group": n,
        "batch_bytes": default,
        "used": DIRECT if direct else common.mib(used) if used is not None else ONE_READ,
        "seconds": seconds,
    }


def _direct_table(rows: list[dict[str, Any]], reps: int) -> Table:
    """Co-located loads: straight into the blocks vs through staging, paired; and vs memcpy."""
    table = Table(
        f"co-located loads with no staging (direct_local_loads, issue #32), ms, median (min..max) of {reps}; "
        "speed-up paired per repetition; memcpy: the same bytes copied once (table above)",
        ["blocks/group", f"{DIRECT} ms", f"staged, {ONE_READ} ms", "speed-up", "direct vs memcpy"],
    )
    for r in rows:
        sec = r["read_ahead"]["seconds"]
        memcpy = r["seconds"]["load"]["memcpy"]
        table.add(
            r["blocks_per_group"],
            Stat.of([1e3 * s for s in sec[DIRECT]]).fmt(),
            Stat.of([1e3 * s for s in sec[ONE_READ]]).fmt(),
            ratios(sec[ONE_READ], sec[DIRECT]).ratio(),
            ratios(memcpy, sec[DIRECT][: len(memcpy)]).ratio(),
        )
    return table


def _read_ahead_table(rows: list[dict[str, Any]], reps: int) -> Table:
    variants = list(rows[0]["read_ahead"]["seconds"]) if rows else []
    reads_ahead = [v for v in variants if v not in (ONE_READ, DIRECT)]
    table = Table(
        f"the load's read-ahead: connector load ms reading ahead in batches of each size and with one "
        f"read a group, median (min..max) of {reps}; speed-up = one read a group / read-ahead, paired "
        "per repetition",
        [
            "placement",
            "blocks/group",
            *(f"read-ahead {v} ms" for v in reads_ahead),
            f"{ONE_READ} ms",
            *(f"speed-up {v}" for v in reads_ahead),
            "connector uses",
        ],
    )
    for r in rows:
        sec = r["read_ahead"]["seconds"]
        table.add(
            r["placement"],
            r["blocks_per_group"],
            *(Stat.of([1e3 * s for s in sec[v]]).fmt() for v in reads_ahead),
            Stat.of([1e3 * s for s in sec[ONE_READ]]).fmt(),
            *(ratios(sec[ONE_READ], sec[v]).ratio() for v in reads_ahead),
            r["read_ahead"]["used"],
        )
    return table


def _header_cost(rig: Rig, n: int, reps: int, *, device_path: bool = False) -> dict[str, Any]:
    """Seconds the object header adds per block: the payload's checksum, packing and writing
    the header (save); reading and checking the header and the payload's checksum (load), on
    this thread's staging buffer; and the bytes it adds.

    ``device_path``: the accelerator's code on a copy of the buffer in host memory (indexed
    torch copies, ``WORD_SUMS`` taken with torch operations), else the CPU's (CRC-32C).
    """
    from kvpool.connector.contract.object_header import HEADER_BYTES, ObjectIdentity, mismatch, pack_header
    from kvpool.connector.contract.payload_checks import Checksum
    from kvpool.connector.worker.staging import StagingSlot

    worker = rig.worker
    copier = worker.copiers[0]
    slot = staging_slot(worker)
    if copier is None or slot is None:
        raise RuntimeError("the worker has no staging buffer")
    if device_path:
        staged = slot
        slot = StagingSlot(staged.nbytes, staged.tensor.device, device_path=True)
        slot.tensor.copy_(staged.tensor)
    size = copier.object_bytes
    count = min(n, slot.nbytes // size)
    kind = Checksum.WORD_SUMS if device_path else Checksum.CRC32C
    checksums = slot.payload_word_sums if device_path else slot.payload_crcs
    fingerprint, payload = worker.keyspace.fingerprint, copier.payload_bytes
    ids = [ObjectIdentity(fingerprint, f"h-{i}", 0, 0, 0, payload) for i in range(count)]
    save, load = [], []
    for _ in range(reps):
        with stopwatch() as t:
            checks = checksums(range(count), size)
            slot.write_headers([pack_header(i, c, kind) for i, c in zip(ids, checks, strict=True)], size)
        save.append(t[0] / count)
        with stopwatch() as t:
            headers = slot.read_headers(count, size)
            bad = [mismatch(h, i) for h, i in zip(headers, ids, strict=True)]
            bad += [None if ok else "payload" for ok in slot.payloads_match(range(count), headers, size)]
        load.append(t[0] / count)
        if any(bad):
            raise RuntimeError(f"a header did not read back: {next(b for b in bad if b)}")
    return {"save_s": save, "load_s": load, "bytes": HEADER_BYTES, "object_bytes": size}


def run(opts: Options) -> Report:
    from kvpool.connector.local.pool import LocalPool

    reps = opts.repetitions(15)
    sizes = SMOKE_SIZES if opts.smoke else SIZES
    rows = []
    probe: list[dict[str, Any]] = []
    with LocalPool(segment_size="1GB") as lp:
        rig = _make_rig(lp.address, max(sizes))
        try:
            for n in sizes:
                rows.append({"placement": REMOTE, **_measure(rig, n, reps)})
                print(f"  {n} blocks per group: done", file=sys.stderr, flush=True)
            rows[-1]["read_ahead"] = _read_ahead(rig, max(sizes), reps)
            if not opts.smoke:
                probe = _probe_one_call(rig, 2 * max(sizes))
        finally:
            rig.worker.shutdown()
            rig.client.close()
        # The engine's own memory in the pool (embedded): its saves stay there, its hits are local.
        rig = _make_rig(lp.address, max(sizes), segment=CO_LOCATED_SEGMENT)
        try:
            for n in sizes:
                rows.append({"placement": CO_LOCATED, **_measure(rig, n, reps)})
                print(f"  {n} blocks per group, co-located: done", file=sys.stderr, flush=True)
            rows[-1]["read_ahead"] = _read_ahead(rig, max(sizes), reps)
        finally:
            rig.worker.shutdown()
            rig.client.close()
    report = _report(rows, reps, opts)
    if probe:
        table = Table(
            "one connector call per group: a save, and a load, of one group's blocks in a single request",
            [
                "op",
                "blocks in the call",
                "buffers in the call",
                "blocks moved",
                "failed (per-key code)",
                "seconds",
            ],
        )
        for r in probe:
            table.add(
                r["op"], r["blocks"], r["entries"], r["moved"], r["failures"] or "-", f"{r['seconds']:.2f}"
            )
        report.tables.append(table)
        report.data["one_call_probe"] = probe
        report.notes.append(
            "The connector sends each block as one object from its staging buffer, so a call carries "
            "one buffer per key (at most batch_size, default 256). Scatter lists of every layer's K and "
            "V runs (12 buffers a key here) failed, over loopback TCP, past about 2,000 buffers a call "
            "with TRANSFER_FAIL, or stalled 60 s first; see the README's findings."
        )
    return report


def _probe_one_call(rig: Rig, n: int) -> list[dict[str, Any]]:
    """Load, then save, ``n`` blocks of group 0 in one connector request (``n`` <= batch_size: one call)."""
    from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestLoad, RequestSave

    worker = rig.worker
    src, dst = list(range(1, n + 1)), list(range(n + 1, 2 * n + 1))
    entries = n  # one staging buffer per key (a raw call of the same blocks: n x 12)
    out = []

    def record() -> Any:
        (rec,) = worker.stats.drain()[1]
        return rec

    # Every block stored in two halves (each call under the limit), then loaded in one call.
    stored = [f"probe-load-{i}" for i in range(n)]
    halves = (slice(0, n // 2), slice(n // 2, n))
    worker.stats.drain()
    for half in halves:
        worker.start_saves(
            PoolConnectorMetadata(saves=[RequestSave("probe", [GroupTransfer(0, stored[half], src[half])])])
        )
        worker.before_forward()
        worker.wait_for_saves()
    saved = sum(r.blocks[0] for r in worker.stats.drain()[1])
    if saved != n:
        raise RuntimeError(f"storing {n} blocks in halves stored only {saved}")
    load = RequestLoad("probe", [GroupTransfer(0, stored, dst)], hit_tokens=n * 32)
    with stopwatch() as t:
        run_loads(worker, [load])
    rec = record()
    worker.take_load_errors()
    out.append(
        {
            "op": "load",
            "blocks": n,
            "entries": entries,
            "moved": rec.blocks[0],
            "failures": dict(rec.failures),
            "seconds": t[0],
        }
    )
    fresh = [f"probe-save-{i}" for i in range(n)]
    with stopwatch() as t:
        worker.start_saves(
            PoolConnectorMetadata(saves=[RequestSave("probe", [GroupTransfer(0, fresh, src)])])
        )
        worker.before_forward()
        worker.wait_for_saves()
    rec = record()
    out.append(
        {
            "op": "save",
            "blocks": n,
            "entries": entries,
            "moved": rec.blocks[0],
            "failures": dict(rec.failures),
            "seconds": t[0],
        }
    )
    rig.client.remove(rig.keys(0, stored) + rig.keys(0, fresh))
    return out


def _header_share(row: dict[str, Any], op: str, field: str = "header") -> tuple[float, float]:
    """(the header's median seconds per block / the connector's, the connector's spread (max-min)/median)."""
    connector = Stat.of(row["seconds"][op]["connector"])
    per_block = connector.median / (2 * row["blocks_per_group"])
    header = Stat.of(row[field][f"{op}_s"]).median
    extra = row[field]["bytes"] / row[field]["object_bytes"]  # more bytes on the wire
    return header / per_block + extra, (connector.high - connector.low) / connector.median


def _header_table(rows: list[dict[str, Any]], reps: int) -> Table:
    table = Table(
        f"the object header: its cost per block, median (min..max) of {reps}, against the connector's time "
        "per block and its run-to-run spread; the CPU path (CRC-32C) and the device path run on CPU "
        "tensors (indexed torch copies, WORD_SUMS)",
        [
            "path",
            "blocks/group",
            "header bytes / object",
            "save: checksum + pack + write µs",
            "load: read + check + checksum µs",
            "save share",
            "load share",
            "save spread",
            "load spread",
        ],
    )
    for path, field in (("CPU", "header"), ("device, on CPU tensors", "header_device")):
        for r in rows:
            if field in r:
                _header_row(table, path, r, field)
    return table


def _header_row(table: Table, path: str, r: dict[str, Any], field: str) -> None:
    h = r[field]
    save_share, save_spread = _header_share(r, "save", field)
    load_share, load_spread = _header_share(r, "load", field)
    table.add(
        path,
        r["blocks_per_group"],
        f"{h['bytes']} / {h['object_bytes']}",
        Stat.of(h["save_s"]).fmt(1e6),
        Stat.of(h["load_s"]).fmt(1e6),
        f"{100 * save_share:.2f}%",
        f"{100 * load_share:.2f}%",
        f"{100 * save_spread:.0f}%",
        f"{100 * load_spread:.0f}%",
    )


def _gbps(nbytes: int, seconds: list[float]) -> Stat:
    return Stat.of([nbytes / s / 1e9 for s in seconds])


def _report(rows: list[dict[str, Any]], reps: int, opts: Options) -> Report:
    report = Report("transfer", "2. Transfer: connector worker vs raw Mooncake batch API vs memcpy", "")
    table = Table(
        f"throughput GB/s, median (min..max) of {reps}; ratios are throughput ratios, paired per repetition",
        [
            "placement",
            "op",
            "blocks/group",
            "bytes",
            "connector GB/s",
            "raw GB/s",
            "memcpy GB/s",
            "connector/raw",
            "connector/memcpy",
        ],
    )
    for r in rows:
        for op in ("load", "save"):
            sec = r["seconds"][op]
            vs_raw = ratios(sec["raw"], sec["connector"])
            vs_mem = ratios(sec["memcpy"], sec["connector"])
            r[f"{op}_vs_raw"], r[f"{op}_vs_memcpy"] = vs_raw.median, vs_mem.median
            table.add(
                r["placement"],
                op,
                r["blocks_per_group"],
                common.mib(r["bytes"]),
                _gbps(r["bytes"], sec["connector"]).fmt(),
                _gbps(r["bytes"], sec["raw"]).fmt(),
                _gbps(r["bytes"], sec["memcpy"]).fmt(),
                vs_raw.ratio(),
                vs_mem.ratio(),
            )
    report.tables.append(table)
    remote = [r for r in rows if r["placement"] == REMOTE]
    last = remote[-1]
    co_located = [r for r in rows if r["placement"] == CO_LOCATED][-1]
    raw_co_located = {
        op: ratios(co_located["seconds"][op]["memcpy"], co_located["seconds"][op]["raw"]).median
        for op in ("load", "save")
    }
    report.tables.append(_header_table(remote, reps))
    report.tables.append(_read_ahead_table([r for r in rows if "read_ahead" in r], reps))
    direct_rows = [r for r in rows if DIRECT in r.get("read_ahead", {}).get("seconds", {})]
    if direct_rows:
        report.tables.append(_direct_table(direct_rows, reps))
    for row in remote:
        for op in ("load", "save"):
            row[f"{op}_header_share"] = _header_share(row, op)
    for op in ("load", "save"):
        share, spread = last[f"{op}_header_share"]
        report.targets.append(
            Target(
                f"{op}: the object header within noise ({last['blocks_per_group']} blocks/group)",
                f"header {100 * share:.2f}% of a block's time, run-to-run spread {100 * spread:.0f}%",
                share <= spread,
            )
        )
    for op in ("load", "save"):
        report.targets.append(
            Target(
                f"{op}: ≥ 0.9x raw ({last['blocks_per_group']} blocks/group)",
                f"{last[f'{op}_vs_raw']:.2f}x",
                last[f"{op}_vs_raw"] >= 0.9,
            )
        )
        report.targets.append(
            Target(
                f"{op}: ≥ 0.5x memcpy ({last['blocks_per_group']} blocks/group)",
                f"{last[f'{op}_vs_memcpy']:.2f}x",
                last[f"{op}_vs_memcpy"] >= 0.5,
                retired=RETIRED_REMOTE,
            )
        )
        report.targets.append(
            Target(
                f"co-located {op}: ≥ 0.5x memcpy ({co_located['blocks_per_group']} blocks/group)",
                f"{co_located[f'{op}_vs_memcpy']:.2f}x (raw Mooncake {raw_co_located[op]:.2f}x)",
                co_located[f"{op}_vs_memcpy"] >= 0.5,
                retired=RETIRED_CO_LOCATED,
            )
        )
    report.notes.append(
        "remote: the pool's memory is in the Mooncake store process; every transfer crosses loopback "
        "TCP (the CPU build has no RDMA), which memcpy does not. co-located: the client contributes "
        "its own segment (an embedded pool) and keeps its saves there, so its loads copy them "
        "straight into the blocks and check them there (direct_local_loads: one copy a load). "
        "The read-ahead table measures the staged load the connector makes otherwise (two copies a "
        "load: segment to staging, staging to the blocks), overlapped batch by batch: the next "
        "batch is read into one half of the buffer while the other is copied into the blocks, each "
        "object's CRC-32C checked on its block right after its copy. The read-ahead table sets that against "
        "larger batches and against one read a group: it pays where reads are local copies and not "
        "over TCP, so the connector reads ahead only when its client holds a segment."
    )
    report.data["rows"] = rows
    path = common.plot_path("transfer", opts)
    if path is not None and _plot(remote, path):
        report.plots.append(str(path.relative_to(common.BENCH_DIR)))
    return report


def _plot(rows: list[dict[str, Any]], path: Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = [r["blocks_per_group"] for r in rows]
    for ax, op in zip(axes, ("load", "save")):
        for v, color in (("connector", "tab:blue"), ("raw", "tab:orange"), ("memcpy", "tab:gray")):
            stats = [_gbps(r["bytes"], r["seconds"][op][v]) for r in rows]
            ax.errorbar(
                xs,
                [s.median for s in stats],
                yerr=[[s.median - s.low for s in stats], [s.high - s.median for s in stats]],
                marker="o",
                capsize=3,
                color=color,
                label=v,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("blocks per group (2 groups, 384 KiB per block)")
        ax.set_ylabel("GB/s (median, min..max)")
        ax.set_title(op)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(common.main("benchmarks.transfer", __doc__, run))
