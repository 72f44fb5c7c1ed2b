"""What every benchmark shares: repeated timings, ratio statistics, tables, reports, CLI."""

from __future__ import annotations

import argparse
import json
import platform
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
PLOTS_DIR = BENCH_DIR / "plots"
MODELS_DIR = REPO_ROOT / ".models"


# --- statistics -----------------------------------------------------------------
@dataclass(frozen=True)
class Stat:
    """Median and range of repeated measurements."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        if not values:
            raise ValueError("no measurements")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def fmt(self, scale: float = 1.0, digits: int = 2) -> str:
        """``median (min..max)`` with values multiplied by ``scale``."""
        lo, mid, hi = self.low * scale, self.median * scale, self.high * scale
        return f"{mid:.{digits}f} ({lo:.{digits}f}..{hi:.{digits}f})"

    def ratio(self, digits: int = 2) -> str:
        return f"{self.median:.{digits}f}x ({self.low:.{digits}f}..{self.high:.{digits}f})"


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> Stat:
    """Per-repetition ratios ``a_i / b_i`` (paired runs), summarised."""
    return Stat.of([a / b for a, b in zip(numerators, denominators, strict=True)])


def rotate(items: Sequence[Any], rep: int) -> list[Any]:
    """``items`` rotated by ``rep``: no variant always runs first (or right after another)."""
    k = rep % len(items)
    return [*items[k:], *items[:k]]


@contextmanager
def stopwatch() -> Iterator[list[float]]:
    """``with stopwatch() as t: ...``; then ``t[0]`` holds the seconds taken."""
    holder: list[float] = []
    started = time.perf_counter()
    try:
        yield holder
    finally:
        holder.append(time.perf_counter() - started)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


# --- tables and reports -----------------------------------------------------------
@dataclass
class Table:
    """A titled table of strings."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        self.rows.append([str(c) for c in cells])

    def text(self) -> str:
        widths = [
            max(len(c), *(len(r[i]) for r in self.rows)) if self.rows else len(c)
            for i, c in enumerate(self.columns)
        ]
        line = "  ".join(c.ljust(w) for c, w in zip(self.columns, widths))
        out = [self.title, line, "  ".join("-" * w for w in widths)]
        out += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in self.rows]
        return "\n".join(out)

    def markdown(self) -> str:
        out = [
            f"**{self.title}**",
            "",
            "| " + " | ".join(self.columns) + " |",
            "|" + "|".join("---" for _ in self.columns) + "|",
        ]
        out += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(out)


@dataclass
class Target:
    """A stated goal and whether this run met it (None: not measurable here).

    ``retired``: why the goal no longer stands (it is still measured and reported).
    """

    goal: str
    measured: str
    met: bool | None
    retired: str = ""

    @property
    def verdict(self) -> str:
        if self.retired:
            return f"retired: {self.retired}"
        return {True: "met", False: "NOT met", None: "n/a"}[self.met]


@dataclass
class Report:
    """One benchmark's outcome: tables, targets, notes, plots and raw numbers."""

    name: str
    title: str
    command: str
    tables: list[Table] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def text(self) -> str:
        parts = [f"=== {self.title} ===", f"command: {self.command}"]
        parts += [t.text() for t in self.tables]
        if self.targets:
            tt = Table("targets", ["goal", "measured", "verdict"])
            for t in self.targets:
                tt.add(t.goal, t.measured, t.verdict)
            parts.append(tt.text())
        parts += [f"note: {n}" for n in self.notes]
        parts += [f"plot: {p}" for p in self.plots]
        return "\n\n".join(parts)

    def markdown(self) -> str:
        parts = [f"### {self.title}", f"`{self.command}`"]
        parts += [t.markdown() for t in self.tables]
        if self.targets:
            tt = Table("Targets", ["goal", "measured", "verdict"])
            for t in self.targets:
                tt.add(t.goal, t.measured, t.verdict)
            parts.append(tt.markdown())
        parts += [f"- {n}" for n in self.notes]
        parts += [f"![{Path(p).stem}](plots/{Path(p).name})" for p in self.plots]
        return "\n\n".join(parts)

    def write(self) -> None:
        RESULTS_DIR.mkdir(exist_ok=True)
        payload = asdict(self)
        payload["machine"] = machine()
        (RESULTS_DIR / f"{self.name}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
        (RESULTS_DIR / f"{self.name}.md").write_text(self.markdown() + "\n")
        update_readme(self.name, self.markdown())
        update_readme("summary", summary_markdown())


def summary_markdown() -> str:
    """Every target of every written result, one table (from ``results/*.json``)."""
    table = Table(
        "Targets and this machine's latest results",
        ["benchmark", "goal", "measured", "verdict", "run"],
    )
    results = [json.loads(p.read_text()) for p in sorted(RESULTS_DIR.glob("*.json"))]
    for r in sorted(results, key=lambda r: r["title"]):
        for t in r["targets"]:
            verdict = Target(**t).verdict
            table.add(
                r["title"].split(":")[0], t["goal"], t["measured"], f"**{verdict}**", r["machine"]["time"]
            )
    return table.markdown()


def update_readme(name: str, markdown: str, readme: Path = BENCH_DIR / "README.md") -> bool:
    """Put ``markdown`` between README's ``<!-- bench:NAME -->`` markers; False if they are missing."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = readme.read_text() if readme.exists() else ""
    if start not in text or end not in text:
        print(f"README has no {start} section: not updated", file=sys.stderr)
        return False
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n{markdown}\n{end}{tail}")
    return True


def machine() -> dict[str, Any]:
    import os

    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


# --- command line -------------------------------------------------------------------
@dataclass
class Options:
    """How a benchmark runs: ``smoke`` is the seconds-long version the tests use."""

    smoke: bool = False
    reps: int | None = None
    write: bool = False

    def repetitions(self, default: int) -> int:
        if self.reps is not None:
            return max(1, self.reps)
        return 1 if self.smoke else default


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition (seconds)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per measurement")
    p.add_argument("--write", action="store_true", help="write results/ and plots/ (the README's data)")
    return p


def command_line(module: str, opts: Options) -> str:
    args = [".venv/bin/python", "-m", module]
    if opts.smoke:
        args.append("--smoke")
    if opts.reps is not None:
        args += ["--reps", str(opts.reps)]
    if opts.write:
        args.append("--write")
    return " ".join(args)


def main(
    module: str, doc: str | None, run: Callable[[Options], Report], argv: list[str] | None = None
) -> int:
    """Parse the common options, run, print the report, write it if asked.

    SIGTERM ends the run as Ctrl-C does (a background run ignores SIGINT): every pool,
    server and namespace it started is stopped on the way out, none is left behind.
    """
    args = parser((doc or module).strip().splitlines()[0]).parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    opts = Options(smoke=args.smoke, reps=args.reps, write=args.write and not args.smoke)
    started = time.perf_counter()
    report = run(opts)
    report.command = command_line(module, opts)
    report.data["wall_seconds"] = round(time.perf_counter() - started, 1)
    print(report.text(), flush=True)
    print(f"\n({module}: {report.data['wall_seconds']} s)", flush=True)
    if opts.write:
        report.write()
    return 0


def plot_path(name: str, opts: Options) -> Path | None:
    """Where a plot goes (only when writing), with its folder made."""
    if not opts.write:
        return None
    PLOTS_DIR.mkdir(exist_ok=True)
    return PLOTS_DIR / f"{name}.png"


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional; tables are not
        print("matplotlib not installed: no plots", file=sys.stderr)
        return None
    return plt


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"
