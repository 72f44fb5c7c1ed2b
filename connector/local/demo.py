"""kvpool-demo: two vLLM engines share a prompt prefix through a Mooncake pool on this machine.

What it starts (all on 127.0.0.1, all stopped before it exits): a Mooncake
master and one store process; a tiny hybrid Gemma3 model (sliding-window and
full attention layers, random weights) built once into --model-dir; then
three vLLM CPU engines, each in its own process, one after another:

* a reference engine without the pool serves prompt P2;
* engine A, with the pool, serves prompt P1 and stores its KV blocks there;
* engine B, with the pool, serves P2, which shares a --prefix-len-token
  prefix with P1.

What it shows: for engine B, per KV-cache group, how many blocks the lookup
found in the pool, how many the hit uses, how many its window masks out, how
many it loaded and their bytes; how many prompt tokens B took from the pool;
and whether B's output equals the reference.

Exit status: 0 (RESULT: OK) when B's output equals the reference and B
took the whole shared prefix (in whole blocks) from the pool; 1 otherwise;
2 for a bad argument (refused before anything starts); 128 + the signal's
number after Ctrl-C (SIGINT) or SIGTERM, which stop the engine and the pool. Killed
(SIGKILL included), it takes them with it: each has a watchdog, and the engine runs in a
process group of its own, ended whole.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

from kvpool.connector.local.engine import EngineOptions, EngineRun, run_engine_subprocess
from kvpool.connector.local.pool import LocalPool
from kvpool.connector.local.stopping import Stopped, raise_on_stop_signals
from kvpool.connector.local.tiny_model import build_gemma3

BLOCK_TOKENS = 32  # EngineOptions.block_size: the pool serves whole blocks
P1_TAIL, P2_TAIL = 40, 50  # tokens each prompt adds after the shared prefix


def prompts(prefix_len: int, seed: int = 7) -> tuple[list[int], list[int]]:
    """Two token-id prompts sharing ``prefix_len`` tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(prefix_len)]
    return prefix + [rng.randrange(3, 500) for _ in range(P1_TAIL)], prefix + [
        rng.randrange(3, 500) for _ in range(P2_TAIL)
    ]


def _timed(label: str, fn: Any) -> tuple[Any, float]:
    print(f"  {label} ...", flush=True)
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def stored_line(run: EngineRun) -> str:
    """What engine A's saves stored, from its records (read after its shutdown drained them)."""
    saves = [t for t in run.transfers if t["operation"] == "save"]
    stored = sum(sum(t["blocks"]) for t in saves)
    failed = sum(sum(t["failures"].values()) for t in saves)
    line = f"engine A stored {stored} blocks"
    if saves:
        per_group = ", ".join(str(sum(t["blocks"][g] for t in saves)) for g in range(len(saves[0]["blocks"])))
        line += f" (per group: {per_group})"
    if failed:
        line += f", {failed} not stored (failed)"
    if run.unreported_saves:
        line += f", {run.unreported_saves} save(s) unreported at its shutdown (not counted)"
    return line


def group_table(run: EngineRun) -> list[str]:
    """Per group: blocks looked up, present, needed by the hit, masked, loaded, bytes."""
    lookups = [r for r in run.lookups if r["hit_tokens"] > 0] or run.lookups
    loads = [t for t in run.transfers if t["operation"] == "load"]
    if not lookups:
        return ["  (no lookups recorded)"]
    lookup = lookups[0]
    rows = [
        f"  {'group':>5}  {'kind':<15} {'looked up':>9} {'in pool':>7} {'hit uses':>8} "
        f"{'masked':>6} {'loaded':>6} {'bytes':>9}"
    ]
    for g, kind in enumerate(lookup["group_kinds"]):
        loaded = sum(t["blocks"][g] for t in loads)
        masked = sum(t["masked"][g] for t in loads)
        nbytes = sum(t["bytes"][g] for t in loads)
        rows.append(
            f"  {g:>5}  {kind:<15} {lookup['looked_up_blocks'][g]:>9} {lookup['present_blocks'][g]:>7} "
            f"{lookup['needed_blocks'][g]:>8} {masked:>6} {loaded:>6} {nbytes:>9}"
        )
    rows.append(f"  lookup: {lookup['keys']} keys asked, {lookup['seconds'] * 1e3:.1f} ms")
    rows.append(f"  load: {sum(t['seconds'] for t in loads) * 1e3:.1f} ms for every group's blocks")
    return rows


def run_demo(model_dir: Path, prefix_len: int, max_tokens: int) -> bool:
    """Run the demo; True when B's output equals the reference and B took the prefix from the pool."""
    from kvpool.connector.contract.settings import ConnectorSettings
    from kvpool.connector.local.recording import recording_transfer_config

    print(f"model: {model_dir}")
    try:
        build_gemma3(model_dir)
    except OSError as exc:
        print(f"kvpool-demo: --model-dir {model_dir}: cannot build the model there: {exc}", file=sys.stderr)
        return False
    p1, p2 = prompts(prefix_len)
    expected_hit = (prefix_len // BLOCK_TOKENS) * BLOCK_TOKENS
    with LocalPool(segment_size="256MB") as pool:
        assert pool.master is not None
        print(f"pool: Mooncake master {pool.address} (metrics {pool.master.metrics_url}), one store")
        settings = ConnectorSettings.parse({"master_server_address": pool.address, "cache_prefix": "demo"})
        config = recording_transfer_config(settings)
        with_pool = EngineOptions(model=str(model_dir), kv_transfer_config=config)
        reference, ref_s = _timed(
            "reference: engine without the pool serves P2",
            lambda: run_engine_subprocess(EngineOptions(model=str(model_dir)), [[p2]], max_tokens),
        )
        a, a_s = _timed(
            "engine A serves P1 and stores its blocks",
            lambda: run_engine_subprocess(with_pool, [[p1]], max_tokens),
        )
        b, b_s = _timed(
            "engine B (new process) serves P2", lambda: run_engine_subprocess(with_pool, [[p2]], max_tokens)
        )
    equal = b.token_ids == reference.token_ids
    cached = b.results[0].num_cached_tokens
    print()
    print(f"P1 {len(p1)} tokens, P2 {len(p2)} tokens, shared prefix {prefix_len} tokens")
    print(stored_line(a))
    print(f"engines: A {a_s:.1f} s, B {b_s:.1f} s, reference {ref_s:.1f} s")
    print("engine B, per KV-cache group:")
    print("\n".join(group_table(b)))
    print(f"engine B tokens from the pool: {cached} (expected {expected_hit})")
    print(f"B's output equals the reference computed without the pool: {'yes' if equal else 'NO'}")
    ok = equal and cached == expected_hit
    print("RESULT:", "OK" if ok else "FAILED")
    return ok


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad arguments before anything starts, naming the option and the rule."""
    if args.prefix_len < BLOCK_TOKENS:
        parser.error(f"--prefix-len: at least {BLOCK_TOKENS} (one block: the pool serves whole blocks)")
    if args.max_tokens < 1:
        parser.error("--max-tokens: at least 1")
    longest = max(P1_TAIL, P2_TAIL) + args.max_tokens
    limit = EngineOptions.max_model_len
    if args.prefix_len + longest > limit:
        parser.error(
            f"--prefix-len: at most {limit - longest} with --max-tokens {args.max_tokens} "
            f"(a prompt adds {max(P1_TAIL, P2_TAIL)} tokens, and the engines' max_model_len is {limit})"
        )


def main(argv: list[str] | None = None) -> int:
    """``kvpool-demo [--model-dir DIR] [--prefix-len N] [--max-tokens N]``."""
    parser = argparse.ArgumentParser(
        prog="kvpool-demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=Path(".models/gemma3-tiny"),
        help="where the tiny model is built, or found already built (default: %(default)s)",
    )
    parser.add_argument(
        "--prefix-len",
        type=int,
        default=300,
        help="tokens P1 and P2 share (default: %(default)s)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=12,
        help="tokens each engine generates per prompt (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    _check(parser, args)
    with raise_on_stop_signals():
        try:
            return 0 if run_demo(args.model_dir, args.prefix_len, args.max_tokens) else 1
        except Stopped as stopped:
            print(f"kvpool-demo: stopped by {stopped}; the engine and the pool are stopped", file=sys.stderr)
            return stopped.exit_status


if __name__ == "__main__":
    sys.exit(main())
