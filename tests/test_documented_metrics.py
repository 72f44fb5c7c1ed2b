"""The README's table of series is the connector's metric list: every series with its labels,
and every reason a failure is counted under."""

from __future__ import annotations

import re
from pathlib import Path

from kvpool.connector.contract import metric_names
from kvpool.connector.contract.metric_names import Kind
from kvpool.connector.pool_client import FAILURE_OUTCOMES

ROOT = Path(__file__).resolve().parents[1]


def _documented() -> dict[str, tuple[set[str], str]]:
    """Series name → (the labels its row names, the row's description)."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| series | labels | what |") :].split("\n\n", 1)[0]
    rows: dict[str, tuple[set[str], str]] = {}
    for line in table.splitlines()[2:]:
        series, labels, what = (cell.strip() for cell in line.strip().strip("|").split("|", 2))
        for name in re.findall(r"`([^`]+)`", series):
            rows[name] = (set(re.findall(r"`([a-z_]+)`", labels)), what)
    return rows


def test_the_readme_names_every_series_with_its_labels() -> None:
    exported = {
        spec.name + ("_total" if spec.kind is Kind.COUNTER else ""): set(spec.labels)
        for spec in metric_names.ALL
    }
    documented = {name: labels for name, (labels, _) in _documented().items()}
    assert documented == exported


def test_the_readme_names_every_failure_reason() -> None:
    _, what = _documented()[metric_names.FAILURES.name + "_total"]
    assert {o.value for o in FAILURE_OUTCOMES} - set(re.findall(r"`([a-z_]+)`", what)) == set()
