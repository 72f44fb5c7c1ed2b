"""values.schema.json: covers every value, accepts the defaults and the examples, and makes
``helm lint`` (and ``helm template``) fail on values that break it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.chart.helm import CHART, Helm, example_values

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
README = CHART / "README.md"


def merged(base: Any, override: Any) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        return {k: merged(base.get(k), v) if k in base else v for k, v in override.items()} | {
            k: v for k, v in base.items() if k not in override
        }
    return override


def all_values() -> list[tuple[str, dict[str, Any]]]:
    cases = [("values.yaml", DEFAULTS)]
    for path in example_values():
        cases.append((path.name, merged(DEFAULTS, yaml.safe_load(path.read_text()))))
    return cases


def schema_nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    for name, sub in node.get("properties", {}).items():
        yield f"{path}.{name}".lstrip("."), sub
        yield from schema_nodes(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from schema_nodes(node["items"], f"{path}[]")


def uncovered(value: Any, node: dict[str, Any], path: str = "") -> Iterator[str]:
    """Value paths the schema does not name (free-form maps, such as labels, stop the walk)."""
    if isinstance(value, dict) and "properties" in node:
        for key, sub in value.items():
            where = f"{path}.{key}".lstrip(".")
            if key in node["properties"]:
                yield from uncovered(sub, node["properties"][key], where)
            elif node.get("additionalProperties", True) is False:
                yield where
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for index, item in enumerate(value):
            yield from uncovered(item, node["items"], f"{path}[{index}]")


def leaves(value: Any, node: dict[str, Any], path: str = "") -> Iterator[str]:
    """Dotted paths of the values the README's table must describe."""
    if isinstance(value, dict) and value and node.get("additionalProperties") is False:
        for key, sub in value.items():
            yield from leaves(sub, node["properties"][key], f"{path}.{key}".lstrip("."))
    else:
        yield path


def test_the_schema_is_a_valid_schema_and_describes_every_value() -> None:
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    assert SCHEMA.get("additionalProperties") is False
    for path, node in schema_nodes(SCHEMA):
        assert node.get("description"), f"{path} has no description"
    documented = {path.split("[")[0] for path, _ in schema_nodes(SCHEMA)}
    assert set(DEFAULTS) <= documented


@pytest.mark.parametrize(("name", "values"), all_values(), ids=[name for name, _ in all_values()])
def test_defaults_and_examples_are_valid_and_covered(name: str, values: dict[str, Any]) -> None:
    jsonschema.Draft7Validator(SCHEMA).validate(values)
    assert list(uncovered(values, SCHEMA)) == []


def test_every_value_is_in_the_readme_table() -> None:
    table = {m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", README.read_text(), re.MULTILINE)}
    paths = {p for _, values in all_values() for p in leaves(values, SCHEMA)}
    assert paths - table == set(), "values missing from the README's values table"
    assert table - paths == set(), "README documents values the chart does not have"


BAD_VALUES = [
    pytest.param(["clusterWide=maybe"], "/clusterWide", id="not-a-boolean"),
    pytest.param(["unknownKey=1"], "unknownKey", id="unknown-key"),
    pytest.param(["operator.resyncIntervall=5"], "resyncIntervall", id="typo"),
    pytest.param(["operator.resyncInterval=0"], "/operator/resyncInterval", id="zero-seconds"),
    pytest.param(["operator.retryDelay=soon"], "/operator/retryDelay", id="not-seconds"),
    pytest.param(["image.pullPolicy=Sometimes"], "/image/pullPolicy", id="enum"),
    pytest.param(["operator.metricsPort=70000"], "/operator/metricsPort", id="port-range"),
    pytest.param(["watchNamespaces[0]=Team_A"], "/watchNamespaces/0", id="namespace-name"),
    pytest.param(
        ["operator.resources.limits.memory=lots"], "/operator/resources/limits/memory", id="quantity"
    ),
    pytest.param(["monitoring.consumers.interval=often"], "/monitoring/consumers/interval", id="duration"),
    pytest.param(["examplePool.spec.image="], "/examplePool/spec/image", id="pool-without-image"),
    pytest.param(
        ["webhook.enabled=true", "webhook.certManager.enabled=false"],
        "/webhook/tls",
        id="webhook-without-tls",
    ),
    pytest.param(["monitoring.dashboards.labels.grafana_dashboard=1"], "grafana_dashboard", id="label-type"),
    pytest.param(
        ["monitoring.prometheusRule.runbookBaseUrl=docs/runbooks.md"],
        "/monitoring/prometheusRule/runbookBaseUrl",
        id="runbook-not-a-url",
    ),
]


@pytest.mark.parametrize(("sets", "where"), BAD_VALUES)
def test_values_that_break_the_schema_fail_lint(helm: Helm, sets: list[str], where: str) -> None:
    result = helm.lint(sets=sets)
    assert result.returncode != 0, result.stdout
    assert "[ERROR]" in result.stdout and where in result.stdout, result.stdout
    rendered = helm.run(
        "template", "kvpool", str(CHART), *[a for s in sets for a in ("--set", s)], check=False
    )
    assert rendered.returncode != 0


def test_a_bad_values_file_fails_lint(helm: Helm, tmp_path: Path) -> None:
    bad = tmp_path / "bad-values.yaml"
    bad.write_text("operator:\n  extraArgs: --verbose\nservice:\n  type: ExternalName\n")
    result = helm.lint(bad)
    assert result.returncode != 0
    assert "/operator/extraArgs" in result.stdout and "/service/type" in result.stdout
