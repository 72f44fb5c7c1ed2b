"""The benchmarks still start and print their tables (``--smoke``: tiny sizes, one repetition).

Benchmarks never run for real in the test pass; this only checks each one runs
end to end, in its own process as ``python -m benchmarks.<name> --smoke``
does. The package is not imported here: it sets environment defaults for
benchmark processes that the tests should not inherit.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAIN = ROOT / "benchmarks" / "__main__.py"


def _benchmarks() -> list[str]:
    """``BENCHMARKS`` from ``benchmarks/__main__.py``, read without importing it."""
    for node in ast.parse(MAIN.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "BENCHMARKS" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("benchmarks/__main__.py defines no BENCHMARKS")


NEEDS = {
    "lookup": [pytest.mark.mooncake],
    "transfer": [pytest.mark.mooncake],
    "tcp_tuning": [pytest.mark.mooncake],
    "bytes_moved": [pytest.mark.mooncake],
    "ttft": [pytest.mark.mooncake, pytest.mark.engine],
    "serving": [pytest.mark.mooncake, pytest.mark.engine],
    "scheduler_overhead": [pytest.mark.mooncake],
    "frozen_pool": [pytest.mark.mooncake],
    "disk_tier": [pytest.mark.mooncake],
}


def _run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_every_module_is_listed() -> None:
    modules = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    helpers = {"__init__", "__main__", "common", "intree", "pool", "vllm_env"}
    helpers |= {"chaos_fleet", "chaos_traffic", "chaos_faults"}  # parts of benchmarks.chaos
    assert modules - helpers == set(_benchmarks())


def test_runner_help() -> None:
    result = _run("-m", "benchmarks", "--help", timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--smoke" in result.stdout


@pytest.mark.parametrize("name", [pytest.param(n, marks=NEEDS.get(n, [])) for n in _benchmarks()])
def test_smoke(name: str) -> None:
    if name in ("chaos", "chaos_colocated"):
        pytest.skip("tests/chaos runs the chaos runs' short variants and checks their judgements")
    if name == "operator_reconcile":
        pytest.importorskip("kvpool.operator.app")
        pytest.importorskip("kmock")
    result = _run("-m", f"benchmarks.{name}", "--smoke")
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-5000:]}"
    out = result.stdout
    assert f"command: .venv/bin/python -m benchmarks.{name} --smoke" in out, out
    assert "median (min..max)" in out, out
    assert "targets" in out, out
