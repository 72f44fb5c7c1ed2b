"""The connector settings the READMEs document are the ones the code has, with its defaults.

The project README's settings table names every ``ConnectorSettings`` field once, and each
default it states in code font is the field's default. The chart README names each field a
pool's ``spec.connector`` takes and each the operator sets from the pool.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.contract.sizes import parse_size
from kvpool.operator.connector_settings import SPEC_FIELDS
from kvpool.operator.spec import CONNECTOR_FIELDS

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ConnectorSettings.model_fields
CODE = re.compile(r"`([^`]+)`")


def _settings_rows() -> dict[str, str]:
    """Field name → the default cell of its row in the README's settings table."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| setting | default | meaning |") :].split("\n\n", 1)[0]
    rows: dict[str, str] = {}
    for line in table.splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        for name in CODE.findall(cells[0]):
            assert name not in rows, f"{name} has two rows"
            rows[name] = cells[1]
    return rows


def _documented_default(name: str, cell: str) -> Any:
    """The default a cell states in code font, as the field holds it; None when it states none."""
    stated = CODE.findall(cell)
    if not stated or stated[0] in FIELDS:  # prose, or another field's value (bind_address)
        return None
    text = stated[0].strip('"')
    default = FIELDS[name].default
    if isinstance(default, bool):
        return {"true": True, "false": False}[text]
    if isinstance(default, str):
        return text
    if name.endswith(("_size", "_bytes")):
        return parse_size(text)
    return type(default)(text)


def test_the_readme_settings_table_has_every_setting_and_its_default() -> None:
    rows = _settings_rows()
    assert set(rows) == set(FIELDS), "the README's settings table and ConnectorSettings differ"
    for name, cell in rows.items():
        stated = _documented_default(name, cell)
        if stated is not None:
            assert stated == FIELDS[name].default, f"{name}: README says {cell}"


def test_the_chart_readme_names_what_a_pool_sets_and_what_it_takes() -> None:
    text = (ROOT / "charts/mooncake-kvpool/README.md").read_text()
    section = text[text.index("## Connector settings of a pool") : text.index("## How full is a pool")]
    takes, sets = section.split("The operator sets these from the pool", 1)
    taken = [name for name in CODE.findall(takes) if name in FIELDS]
    assert taken == list(CONNECTOR_FIELDS), "spec.connector's fields as the chart README lists them"
    named = set(CODE.findall(sets.split("Every other setting", 1)[0]))
    assert set(SPEC_FIELDS) - named == set(), "settings the operator sets that the chart README leaves out"
