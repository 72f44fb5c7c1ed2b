"""Run every benchmark, each in a fresh process: ``python -m benchmarks [--smoke] [--reps N] [--write]``.

A process per benchmark keeps them apart (vLLM's distributed state, engines,
threads, memory) and is exactly how each one runs alone
(``python -m benchmarks.<name>``). ``--only a,b`` picks some.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from benchmarks.common import REPO_ROOT

BENCHMARKS = (
    "lookup",
    "transfer",
    "tcp_tuning",
    "bytes_moved",
    "ttft",
    "scheduler_overhead",
    "operator_reconcile",
    "serving",
    "frozen_pool",
    "disk_tier",
    "chaos",
    "chaos_colocated",
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition (seconds each)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per measurement")
    p.add_argument("--write", action="store_true", help="write results/, plots/ and README sections")
    p.add_argument("--only", default="", help=f"comma-separated subset of {', '.join(BENCHMARKS)}")
    args = p.parse_args(argv)
    chosen = [b.strip() for b in args.only.split(",") if b.strip()] or list(BENCHMARKS)
    unknown = sorted(set(chosen) - set(BENCHMARKS))
    if unknown:
        p.error(f"unknown benchmark(s): {', '.join(unknown)}")
    passthrough = (["--smoke"] if args.smoke else []) + (["--write"] if args.write else [])
    if args.reps is not None:
        passthrough += ["--reps", str(args.reps)]
    failed = []
    for name in chosen:
        started = time.perf_counter()
        print(f"\n##### benchmarks.{name}", flush=True)
        rc = subprocess.call([sys.executable, "-m", f"benchmarks.{name}", *passthrough], cwd=REPO_ROOT)
        print(f"##### benchmarks.{name}: rc={rc}, {time.perf_counter() - started:.0f} s", flush=True)
        if rc != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
