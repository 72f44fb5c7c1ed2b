"""The benchmark report shows the committed results: each ``results/NAME.md`` is what its
``NAME.json`` renders, and ``benchmarks/README.md`` holds each of them, and the summary of all,
between its markers, unedited.

Checked in a child interpreter: importing the ``benchmarks`` package quiets vLLM's and
Mooncake's logs for every engine this process would start later (tests read those logs).
"""

from __future__ import annotations

from testing.child_processes import ROOT, python_answer

CHECK = """
import json, re, sys
from pathlib import Path
from benchmarks.common import RESULTS_DIR, Report, Table, Target, summary_markdown

readme = Path(sys.argv[1]).read_text()
stale = []
for path in sorted(RESULTS_DIR.glob("*.json")):
    raw = json.loads(path.read_text())
    raw.pop("machine")
    raw["tables"] = [Table(**t) for t in raw["tables"]]
    raw["targets"] = [Target(**t) for t in raw["targets"]]
    markdown = Report(**raw).markdown()
    if path.with_suffix(".md").read_text() != markdown + "\\n":
        stale.append(f"results/{path.stem}.md")
    if f"<!-- bench:{path.stem} -->\\n{markdown}\\n<!-- /bench:{path.stem} -->" not in readme:
        stale.append(f"README section {path.stem}")
if f"<!-- bench:summary -->\\n{summary_markdown()}\\n<!-- /bench:summary -->" not in readme:
    stale.append("README summary")
print(json.dumps(stale))
"""


def test_the_report_shows_the_committed_results() -> None:
    assert python_answer(CHECK, str(ROOT / "benchmarks" / "README.md")) == []
