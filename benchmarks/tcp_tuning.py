"""TCP tuning: the remote transfer (loopback TCP) under Mooncake's TCP settings, connector vs raw.

The remote rig of ``benchmarks.transfer`` (its ``_make_rig`` and ``_measure``:
the pool's memory in a separate store process, every transfer across loopback
TCP; 128 blocks per group, 96 MiB a load or save) runs once per setting of
Mooncake's TCP transport, each in a fresh child process
(``python -m benchmarks.tcp_tuning --child NAME``) whose environment carries the
setting, as does the ``LocalPool`` (master and store) it starts: Mooncake reads
these variables when a transfer engine is set up, and ``MC_TCP_SLICE_SIZE``
once per process. What the installed wheel (0.3.13.post1) reads, from
Mooncake's ``mooncake-transfer-engine/src/transport/tcp_transport/``:

* ``MC_TCP_ENABLE_CONNECTION_POOL`` (on in this wheel, as in Mooncake's
  ``release/v0.3.12`` branch, commit c4fda811e; off in its main branch): on,
  requests queue per peer and go out over that peer's fixed, reused
  connections ("lanes"); ``0``: every request (one per buffer) opens and closes
  a connection of its own (raw then ran at 0.02 GB/s and left 12,700 sockets in
  TIME_WAIT per child here: not measured).
* ``MC_TCP_LANES_PER_PEER`` (4, 1..16; ``MC_TCP_MAX_CONNECTIONS_PER_PEER`` is
  its deprecated alias): the lanes per peer, i.e. the requests in flight to it.
* ``MC_TCP_SLICE_SIZE`` (65536): the bytes of one socket read or write, both
  ends (the store process serves with its own value).
* ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` (1024): requests queued per peer
  before new ones wait for admission (1024 more, 1 s each); a bound, not a speed knob.
* ``MC_TCP_PROTO`` (unset): ``1`` forces the legacy framing whose writes
  complete before the receiver applied them; a rollback hatch, not measured.
* ``MC_WORKERS_PER_CTX`` (2): worker threads per RDMA/UB context; TCP ignores it.

Rounds: every round starts one child per setting, in an order rotated by the
round; each child measures ``INNER_REPS`` repetitions (connector, raw and memcpy
in rotated order, as ``benchmarks.transfer`` does). ``--reps`` sets the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import Options, Report, Stat, Table, Target, ratios, rotate

POOL = "MC_TCP_ENABLE_CONNECTION_POOL"
LANES = "MC_TCP_LANES_PER_PEER"
SLICE = "MC_TCP_SLICE_SIZE"
#: Every TCP setting of Mooncake's: a child starts with none of them but its own.
TUNING_VARS = (
    POOL,
    LANES,
    "MC_TCP_MAX_CONNECTIONS_PER_PEER",
    SLICE,
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER",
    "MC_TCP_ADMISSION_TIMEOUT_MS",
    "MC_TCP_PROTO",
    "MC_WORKERS_PER_CTX",
)


@dataclass(frozen=True)
class Variant:
    """A named setting: the variables its child process and store start with."""

    name: str
    env: tuple[tuple[str, str], ...] = ()

    @property
    def env_text(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.env) or "(Mooncake defaults)"


DEFAULT = Variant("default")
VARIANTS = (
    DEFAULT,
    Variant("lanes 1", ((LANES, "1"),)),
    Variant("lanes 2", ((LANES, "2"),)),
    Variant("lanes 8", ((LANES, "8"),)),
    Variant("lanes 16", ((LANES, "16"),)),
    Variant("slice 16 KiB", ((SLICE, str(16 << 10)),)),
    Variant("slice 1 MiB", ((SLICE, str(1 << 20)),)),
    Variant("lanes 16, slice 1 MiB", ((LANES, "16"), (SLICE, str(1 << 20)))),
)
SMOKE_VARIANTS = (DEFAULT, Variant("lanes 2", ((LANES, "2"),)))
BLOCKS = 128
SMOKE_BLOCKS = 4
INNER_REPS = 4
OPS = ("load", "save")
RESULT_MARK = "TCP_TUNING_RESULT "
CHILD_TIMEOUT_S = 300.0


# --- the child: one setting, one pool, one rig ------------------------------------------
def _process_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _child(name: str, blocks: int, reps: int) -> dict[str, Any]:
    """Measure the remote rig under this process's environment (the parent set the variant's)."""
    from benchmarks.transfer import _make_rig, _measure
    from kvpool.connector.local.pool import LocalPool

    variant = {v.name: v for v in (*VARIANTS, *SMOKE_VARIANTS)}[name]
    wanted = dict(variant.env)
    ours = {k: os.environ[k] for k in TUNING_VARS if k in os.environ}
    if ours != wanted:
        raise RuntimeError(f"child of {name!r} has {ours}, expected {wanted}")
    with LocalPool(segment_size="1GB") as lp:
        assert lp.store is not None and lp.store.process is not None
        store_env = _process_env(lp.store.process.pid)
        theirs = {k: store_env[k] for k in TUNING_VARS if k in store_env}
        if theirs != wanted:
            raise RuntimeError(f"the store of {name!r} has {theirs}, expected {wanted}")
        rig = _make_rig(lp.address, blocks)
        try:
            measured = _measure(rig, blocks, reps)
        finally:
            rig.worker.shutdown()
            rig.client.close()
    return {
        "variant": name,
        "env": wanted,
        "store_env": theirs,
        "blocks_per_group": blocks,
        "bytes": measured["bytes"],
        "seconds": measured["seconds"],
    }


def _child_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="one setting's measurement (run by benchmarks.tcp_tuning)")
    p.add_argument("--child", required=True)
    p.add_argument("--blocks", type=int, default=BLOCKS)
    p.add_argument("--reps", type=int, default=INNER_REPS)
    args = p.parse_args(argv)

    def stop(signum: int, frame: Any) -> None:  # the parent's timeout: stop the pool on the way out
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    result = _child(args.child, args.blocks, args.reps)
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0


def _run_child(variant: Variant, blocks: int, reps: int) -> dict[str, Any]:
    """One child for ``variant``: its environment, without any other TCP setting."""
    env = {k: v for k, v in os.environ.items() if k not in TUNING_VARS}
    env.update(variant.env)
    command = [sys.executable, "-m", "benchmarks.tcp_tuning", "--child", variant.name]
    command += ["--blocks", str(blocks), "--reps", str(reps)]
    process = subprocess.Popen(
        command, cwd=common.REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = process.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.terminate()  # its SIGTERM handler stops the pool it started
        try:
            out, err = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        raise RuntimeError(f"{variant.name}: no result in {CHILD_TIMEOUT_S:.0f} s\n{err[-3000:]}") from None
    lines = [line for line in out.splitlines() if line.startswith(RESULT_MARK)]
    if process.returncode != 0 or not lines:
        raise RuntimeError(f"{variant.name}: child exited with {process.returncode}\n{err[-3000:]}")
    return json.loads(lines[-1][len(RESULT_MARK) :])


# --- the parent: rounds of children, then the report ----------------------------------------
def run(opts: Options) -> Report:
    rounds = opts.repetitions(3)
    variants = SMOKE_VARIANTS if opts.smoke else VARIANTS
    blocks = SMOKE_BLOCKS if opts.smoke else BLOCKS
    inner = 1 if opts.smoke else INNER_REPS
    results: dict[str, list[dict[str, Any]]] = {v.name: [] for v in variants}
    for r in range(rounds):
        for v in rotate(variants, r):
            results[v.name].append(_run_child(v, blocks, inner))
            print(f"  round {r + 1}/{rounds}: {v.name} done", file=sys.stderr, flush=True)
    return _report(variants, results, rounds, inner, blocks)


def _gbps(result: dict[str, Any], op: str, way: str) -> list[float]:
    return [result["bytes"] / s / 1e9 for s in result["seconds"][op][way]]


def _pooled(results: list[dict[str, Any]], op: str, way: str) -> Stat:
    return Stat.of([g for r in results for g in _gbps(r, op, way)])


def _paired(results: list[dict[str, Any]], op: str) -> list[float]:
    """Per-repetition connector/raw throughput ratios of every child of a setting."""
    out: list[float] = []
    for r in results:
        sec = r["seconds"][op]
        out += [raw / conn for raw, conn in zip(sec["raw"], sec["connector"], strict=True)]
    return out


def _vs_default(results: list[dict[str, Any]], default: list[dict[str, Any]], op: str, way: str) -> Stat:
    """The setting's median throughput over the default's, paired per round (same round, same order)."""
    return ratios(
        [statistics.median(_gbps(r, op, way)) for r in results],
        [statistics.median(_gbps(d, op, way)) for d in default],
    )


def _report(
    variants: tuple[Variant, ...],
    results: dict[str, list[dict[str, Any]]],
    rounds: int,
    inner: int,
    blocks: int,
) -> Report:
    report = Report(
        "tcp_tuning", "2b. TCP tuning: remote transfer under Mooncake's TCP settings, connector vs raw", ""
    )
    nbytes = results[DEFAULT.name][0]["bytes"]
    main = Table(
        f"remote, {blocks} blocks/group ({common.mib(nbytes)} a load or save): GB/s, median (min..max) of "
        f"{rounds} rounds x {inner} reps; connector/raw paired per repetition",
        [
            "setting",
            "env",
            "connector load GB/s",
            "raw load GB/s",
            "connector save GB/s",
            "raw save GB/s",
            "load connector/raw",
            "save connector/raw",
        ],
    )
    versus = Table(
        f"each setting over the default: median (min..max) of {rounds} per-round ratios of median GB/s "
        "(the setting's child and the default's child of the same round)",
        ["setting", "connector load", "connector save", "raw load", "raw save"],
    )
    summary: dict[str, dict[str, Any]] = {}
    for v in variants:
        res = results[v.name]
        vs_raw = {op: Stat.of(_paired(res, op)) for op in OPS}
        vs_default = {
            f"{way} {op}": _vs_default(res, results[DEFAULT.name], op, way)
            for way in ("connector", "raw")
            for op in OPS
        }
        main.add(
            v.name,
            v.env_text,
            _pooled(res, "load", "connector").fmt(),
            _pooled(res, "load", "raw").fmt(),
            _pooled(res, "save", "connector").fmt(),
            _pooled(res, "save", "raw").fmt(),
            vs_raw["load"].ratio(),
            vs_raw["save"].ratio(),
        )
        if v != DEFAULT:
            versus.add(v.name, *(vs_default[k].ratio() for k in vs_default))
        summary[v.name] = {
            "env": dict(v.env),
            "connector_vs_raw": {op: vs_raw[op].__dict__ for op in OPS},
            "vs_default": {k: s.__dict__ for k, s in vs_default.items()},
        }
    report.tables += [main, versus]

    for op in OPS:
        worst = min(variants, key=lambda v: summary[v.name]["connector_vs_raw"][op]["median"])
        low = summary[worst.name]["connector_vs_raw"][op]["median"]
        report.targets.append(
            Target(
                f"remote {op}: connector ≥ 0.9x raw under every setting",
                f"lowest {low:.2f}x ({worst.name})",
                all(summary[v.name]["connector_vs_raw"][op]["median"] >= 0.9 for v in variants),
            )
        )
    others = [v for v in variants if v != DEFAULT]
    if others:
        best = max(others, key=lambda v: _gain(summary[v.name]))
        ld = summary[best.name]["vs_default"]["connector load"]
        sv = summary[best.name]["vs_default"]["connector save"]
        clear = [v.name for v in others if _clear_gain(summary[v.name])]
        report.targets.append(
            Target(
                "best setting's connector gain over the default (informational)",
                f"{best.name}: load {_fmt(ld)}, save {_fmt(sv)}; ≥ 1.10x on both with the range above 1.0: "
                f"{', '.join(clear) or 'none'}",
                None,
            )
        )
    report.notes += [
        f"Each round starts a fresh child process per setting (its own master, store and client, "
        f"the setting in all three's environment; the store's is read back from /proc), in an order "
        f"rotated by the round; a child measures {inner} repetitions. A setting's ratio to the default "
        "pairs its child with the default's child of the same round, so drift between rounds cancels; "
        "drift within a round does not, which the rotation spreads over the settings.",
        "Every setting keeps this wheel's connection pool on (its default): requests to the store go "
        "out over the lanes. Raw moves 12 buffers of 32 KiB per block (a request each), the connector "
        "one 384 KiB object per block (a request each); MC_TCP_SLICE_SIZE splits each request into "
        "socket reads and writes of that size, at both ends.",
    ]
    report.data.update(
        {
            "blocks_per_group": blocks,
            "rounds": rounds,
            "inner_reps": inner,
            "variants": [{"name": v.name, "env": dict(v.env)} for v in variants],
            "results": results,
            "summary": summary,
        }
    )
    return report


def _fmt(stat: dict[str, Any]) -> str:
    return f"{stat['median']:.2f}x ({stat['low']:.2f}..{stat['high']:.2f})"


def _gain(entry: dict[str, Any]) -> float:
    """The geometric mean of a setting's connector load and save medians over the default's."""
    vs = entry["vs_default"]
    return (vs["connector load"]["median"] * vs["connector save"]["median"]) ** 0.5


def _clear_gain(entry: dict[str, Any]) -> bool:
    """≥ 10% faster than the default on connector load and save, every round's ratio above 1."""
    vs = entry["vs_default"]
    return all(vs[k]["median"] >= 1.10 and vs[k]["low"] > 1.0 for k in ("connector load", "connector save"))


if __name__ == "__main__":
    if "--child" in sys.argv[1:]:
        sys.exit(_child_main(sys.argv[1:]))
    sys.exit(common.main("benchmarks.tcp_tuning", __doc__, run))
