"""Every generated file in the repository equals what its generator writes today."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "generate.py"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvpool_generate", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_generated_file_is_current() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_generator_covers_the_chart_and_its_docs() -> None:
    paths = set(_generator().generated_files())
    chart = "charts/mooncake-kvpool/"
    assert {
        chart + "README.md",
        chart + "values.schema.json",
        chart + "files/alerts.yaml",
        chart + "crds/mooncakekvpools.yaml",
    } <= paths
    assert any(p.startswith(chart + "templates/") or "rbac" in p for p in paths), "RBAC is generated"


def test_every_value_is_described_once_in_values_yaml() -> None:
    generate = _generator()
    import yaml

    values_text = (REPO / generate.VALUES).read_text()
    described = generate.value_descriptions(values_text)
    values = yaml.safe_load(values_text)

    def leaves(node: object, prefix: str = "") -> list[str]:
        if isinstance(node, dict) and node and prefix not in described:
            paths = (f"{prefix}.{key}".strip(".") for key in node)
            return [leaf for path, child in zip(paths, node.values()) for leaf in leaves(child, path)]
        return [prefix]

    assert [leaf for leaf in leaves(values) if leaf not in described] == []


def test_the_values_table_reads_comments_and_defaults() -> None:
    generate = _generator()
    text = "# section\nimage:\n  # -- Where the image\n  # lives.\n  repository: x\n  tag: ''\nlist: [a]\n"
    assert generate.value_descriptions(text) == {"image.repository": "Where the image lives."}
    assert '| `image.repository` | `"x"` | Where the image lives. |' in generate.values_table(text)
