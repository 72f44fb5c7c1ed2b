"""Who may import whom: the product imports no scaffolding; scaffolding and benchmarks import no test.

``testing`` is what ``tests`` and ``benchmarks`` share; a benchmark that imported ``tests``
would depend on test modules (and their fixtures' side effects), and the product must run
without any of the three.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: Top-level folder -> the top-level packages its modules must not import.
FORBIDDEN = {
    "connector": {"testing", "tests", "benchmarks"},
    "operator": {"testing", "tests", "benchmarks"},
    "dashboards": {"testing", "tests", "benchmarks"},
    "testing": {"tests", "benchmarks"},
    "benchmarks": {"tests"},
}


def imported_tops(path: Path) -> set[str]:
    """The top-level package of every absolute import in ``path``, lazy imports included."""
    tops = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            tops |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return tops


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_folder_imports_what_it_must_not(folder: str) -> None:
    offenders = {
        str(path.relative_to(REPO)): sorted(imported_tops(path) & FORBIDDEN[folder])
        for path in sorted((REPO / folder).rglob("*.py"))
        if imported_tops(path) & FORBIDDEN[folder]
    }
    assert not offenders
