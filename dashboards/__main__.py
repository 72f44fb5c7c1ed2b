"""``python -m dashboards`` writes the dashboards and rules; ``--check`` only compares."""

from __future__ import annotations

import argparse
import sys

from dashboards.generate import ROOT, outputs, stale, write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated file is out of date")
    args = parser.parse_args(argv)
    if args.check:
        out_of_date = stale(ROOT)
        for path in out_of_date:
            print(f"out of date: {path}", file=sys.stderr)
        return 1 if out_of_date else 0
    changed = write(ROOT)
    for path in outputs():
        print(f"{'wrote' if path in changed else 'unchanged'} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
