"""The module maps name every module: a new one is placed in them, a gone one leaves them.

docs/architecture.md has a table of the contract's modules, the connector's and the
operator's; operator/README.md has the operator's; the README's repository table lists the
contract's.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()


def _modules(folder: str) -> set[str]:
    return {p.relative_to(ROOT / folder).as_posix() for p in (ROOT / folder).glob("*.py")} - {"__init__.py"}


def _section(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same or a higher level."""
    level = heading.split(" ", 1)[0]
    start = text.index(f"\n{heading}\n")
    end = re.search(rf"\n#{{1,{len(level)}}} ", text[start + 1 :])
    return text[start : start + 1 + end.start()] if end else text[start:]


def _first_cells(table_text: str) -> set[str]:
    """Every name in code font in the first cell of a table row."""
    cells = re.findall(r"^\| ([^|]+) \|", table_text, re.MULTILINE)
    return {name for cell in cells for name in re.findall(r"`([^`]+)`", cell)}


def test_the_architecture_maps_the_contracts_modules() -> None:
    named = _first_cells(_section(ARCHITECTURE, "## The contract both sides share"))
    assert {m.removesuffix(".py") for m in _modules("connector/contract")} - named == set()


def test_the_readme_lists_the_contracts_modules() -> None:
    row = next(
        line
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith("| `connector/contract/`")
    )
    assert _modules("connector/contract") - set(re.findall(r"`([a-z_]+\.py)`", row)) == set()


def test_the_architecture_maps_the_connectors_modules() -> None:
    named = _first_cells(_section(ARCHITECTURE, "## The connector's modules"))
    modules = _modules("connector") | {
        f"{folder}/{m}"
        for folder in ("scheduler", "worker", "integrity", "observability")
        for m in _modules(f"connector/{folder}")
    }
    assert modules - named == set()


def test_the_operator_maps_name_every_module() -> None:
    modules = _modules("operator")
    in_architecture = _first_cells(_section(ARCHITECTURE, "## The operator's modules"))
    in_readme = _first_cells(_section((ROOT / "operator" / "README.md").read_text(), "## Modules"))
    assert modules - in_architecture == set(), "docs/architecture.md"
    assert modules - in_readme == set(), "operator/README.md"
