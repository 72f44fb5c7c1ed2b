#!/usr/bin/env python3
"""Write every generated file of the repository, or check that each is current.

One command for every artefact that is derived from another source:

* the Grafana dashboards and the alert rules (from the metric names in code,
  ``dashboards.generate``) into the chart's ``files/``;
* the CRD and the RBAC rules (from the operator's models and rule list) into
  the chart;
* the chart README's values table and the descriptions in
  ``values.schema.json`` (from the ``# --`` comments of ``values.yaml``);
* the chart's ``version`` and ``appVersion`` (from ``pyproject.toml``, the one
  version source).

Usage: ``python scripts/generate.py`` writes; ``--check`` exits 1 naming each
file that is out of date.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the dashboards package lives beside the product

CHART = Path("charts/mooncake-kvpool")
VALUES = CHART / "values.yaml"
SCHEMA = CHART / "values.schema.json"
CHART_README = CHART / "README.md"
CHART_YAML = CHART / "Chart.yaml"
TABLE_BEGIN = "<!-- values table: generated from values.yaml by scripts/generate.py -->"
TABLE_END = "<!-- end of values table -->"
DESCRIPTION = re.compile(r"^\s*# -- (?P<text>.*)$")
CONTINUATION = re.compile(r"^\s*#(?! --) ?(?P<text>.*)$")
KEY = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z0-9_]+):")
LONG_DEFAULT = 60


def value_descriptions(values_text: str) -> dict[str, str]:
    """Dotted value path → its ``# --`` comment (continuation lines joined)."""
    described: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    pending: list[str] | None = None
    for line in values_text.splitlines():
        if match := DESCRIPTION.match(line):
            pending = [match["text"].strip()]
            continue
        if pending is not None and (match := CONTINUATION.match(line)):
            pending.append(match["text"].strip())
            continue
        if line.lstrip().startswith("#") or not line.strip():
            pending = None
            continue
        if match := KEY.match(line):
            indent = len(match["indent"])
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, match["key"]))
            if pending is not None:
                described[".".join(key for _, key in stack)] = " ".join(pending)
        pending = None
    return described


def _lookup(values: dict[str, Any], path: str) -> Any:
    node: Any = values
    for key in path.split("."):
        node = node[key]
    return node


def _default(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return "see values.yaml" if len(text) > LONG_DEFAULT else f"`{text}`"


def values_table(values_text: str) -> str:
    """The README's values table: every described value, its default and meaning."""
    values = yaml.safe_load(values_text)
    rows = ["| value | default | meaning |", "|---|---|---|"]
    for path, text in value_descriptions(values_text).items():
        meaning = text.replace("|", "\\|")
        rows.append(f"| `{path}` | {_default(_lookup(values, path))} | {meaning} |")
    return "\n".join(rows)


def readme_with_table(readme: str, table: str) -> str:
    """``readme`` with the text between the table markers replaced by ``table``."""
    begin, end = readme.index(TABLE_BEGIN), readme.index(TABLE_END)
    return readme[: begin + len(TABLE_BEGIN)] + "\n\n" + table + "\n\n" + readme[end:]


def _schema_nodes(schema: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    for key, node in schema.get("properties", {}).items():
        path = f"{prefix}.{key}" if prefix else key
        yield path, node
        yield from _schema_nodes(node, path)


def schema_with_descriptions(schema_text: str, values_text: str) -> str:
    """The values schema with each described value's description from values.yaml."""
    schema = json.loads(schema_text)
    described = value_descriptions(values_text)
    for path, node in _schema_nodes(schema):
        if path in described:
            node["description"] = described[path]
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def project_version(root: Path) -> str:
    """The version in ``pyproject.toml``."""
    return str(tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"])


def chart_with_version(chart_text: str, version: str) -> str:
    """Chart.yaml with ``version`` and ``appVersion`` set to the project's version."""
    chart_text = re.sub(r"(?m)^version: .*$", f"version: {version}", chart_text)
    return re.sub(r"(?m)^appVersion: .*$", f'appVersion: "{version}"', chart_text)


def chart_docs(root: Path) -> dict[str, str]:
    values_text = (root / VALUES).read_text()
    return {
        str(CHART_YAML): chart_with_version((root / CHART_YAML).read_text(), project_version(root)),
        str(CHART_README): readme_with_table((root / CHART_README).read_text(), values_table(values_text)),
        str(SCHEMA): schema_with_descriptions((root / SCHEMA).read_text(), values_text),
    }


def generated_files(root: Path = ROOT) -> dict[str, str]:
    """Every generated file: repository-relative path → content."""
    from dashboards.generate import outputs as dashboard_outputs
    from kvpool.operator.generated import generated_files as operator_files

    files = {str(path): text for path, text in dashboard_outputs().items()}
    files.update(operator_files())
    files.update(chart_docs(root))
    return files


def stale(root: Path = ROOT) -> list[str]:
    """Generated files that are missing or differ from what the generators produce."""
    return sorted(
        path
        for path, text in generated_files(root).items()
        if not (root / path).exists() or (root / path).read_text() != text
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated file is out of date")
    args = parser.parse_args(argv)
    if args.check:
        out_of_date = stale()
        for path in out_of_date:
            print(f"out of date: {path} (run: python scripts/generate.py)", file=sys.stderr)
        return 1 if out_of_date else 0
    for path, text in generated_files().items():
        target = ROOT / path
        if target.exists() and target.read_text() == text:
            print(f"unchanged {path}")
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
