"""The chaos runs' short variants: a fleet under every fault kind, judged; and its negative control.

``python -m benchmarks.chaos --smoke`` in its own process (as a user runs it): about two
minutes of traffic on two vLLM servers over an HA pool, every fault kind injected at least
once, then the negative control (the payload check off while objects are overwritten). The
run exits non-zero when any target of its judgement is not met; this test reads the
judgement it wrote and names what failed. ``benchmarks.chaos_colocated --smoke`` is the
same with no store process: the servers hold the pool's memory, and one is frozen.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testing.chaos_history import read

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.engine, pytest.mark.mooncake, pytest.mark.faults, pytest.mark.timeout(1500)]


STORE_FAULTS = {"store_frozen", "store_restarted"}


@pytest.mark.parametrize("module", ["chaos", "chaos_colocated"])
def test_the_short_chaos_run_is_right_bounded_and_catches_its_negative_control(
    module: str, tmp_path: Path
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1400,
        check=False,
    )
    # The run's output goes to the report's captured stdout; each failure's message (what CI's
    # summary line shows) names what was not met and the judgement's numbers.
    print(f"stdout:\n{done.stdout[-6000:]}\nstderr:\n{done.stderr[-4000:]}")
    check_short_run(tmp_path, done.returncode)
    judgement = json.loads((tmp_path / "judgement.json").read_text())
    injected = set(judgement["injected"])
    if module == "chaos_colocated":  # no store to fault: a server frozen instead, with its segment
        assert "server_frozen" in injected and not injected & STORE_FAULTS, summary(judgement)
    else:
        assert injected >= STORE_FAULTS and "server_frozen" not in injected, summary(judgement)


def check_short_run(out_dir: Path, returncode: int) -> None:
    """What a short run kept in ``out_dir`` must show (its output is in the captured stdout)."""
    assert (out_dir / "judgement.json").exists(), f"the run exited {returncode} with no judgement"
    judgement = json.loads((out_dir / "judgement.json").read_text())
    chaos = read(out_dir / "history.jsonl").phase("chaos")
    why = summary(judgement)
    # Every fault kind the platform allows was injected, and each one is in the history.
    assert judgement["injected"] and all(n >= 1 for n in judgement["injected"].values()), why
    assert {f.kind for f in chaos.faults} >= set(judgement["injected"]), why
    # Traffic ran throughout, and most of it completed.
    assert judgement["completed"] > 50, why
    # The judgement: right answers, nothing hung, no unexplained break, /metrics agreeing.
    assert judgement["wrong"] == 0, why
    assert judgement["hung"] == 0, why
    assert judgement["failed"] == 0, why
    assert judgement["metrics_disagreements"] == [], why
    assert judgement["leaks"] == [], why
    # The negative control: with the payload check off, overwritten objects were served as KV.
    assert judgement["control_wrong"] > 0, why
    # And every other target of the run (the hit rate's recoveries among them) was met.
    assert returncode == 0, f"the run exited {returncode} (a target not met: its table is in stdout); {why}"


#: The judgement's numbers a failure names, in one line.
SUMMARY_FIELDS = (
    "injected",
    "completed",
    "wrong",
    "hung",
    "failed",
    "refused",
    "control_wrong",
    "control_completed",
    "leaks",
    "metrics_disagreements",
)


def summary(judgement: dict[str, object]) -> str:
    """The judgement's numbers, with each fault's recoveries (seconds), in one line."""
    numbers = {name: judgement.get(name) for name in SUMMARY_FIELDS}
    kinds = judgement.get("kinds")
    if isinstance(kinds, list):
        numbers["recoveries"] = {k.get("kind"): k.get("recoveries") for k in kinds if isinstance(k, dict)}
    return "judgement: " + json.dumps(numbers, separators=(",", ":"))
