"""The chart's CRD is the operator's generated one; example pools are valid custom resources."""

from __future__ import annotations

import copy
import re
from typing import Any

import jsonschema
import pytest
import yaml

from kvpool.operator import validation
from kvpool.operator.crd import build_crd, build_grant_crd
from kvpool.operator.generated import CRD_PATH, GRANT_CRD_PATH
from tests.chart.helm import CHART, EXAMPLES, ROOT, Helm, of_kind, one

CRD_FILE = ROOT / CRD_PATH


def test_the_chart_ships_the_operators_crds_alone() -> None:
    assert CRD_FILE.parent == CHART / "crds"
    shipped = sorted(p.name for p in CRD_FILE.parent.iterdir())
    assert shipped == sorted([CRD_FILE.name, (ROOT / GRANT_CRD_PATH).name])


def test_helm_installs_them(helm: Helm) -> None:
    crds = {c["metadata"]["name"]: c for c in of_kind(helm.template(), "CustomResourceDefinition")}
    expected = [build_crd(), build_grant_crd()]
    assert crds == {c["metadata"]["name"]: c for c in expected}


def crd_validator() -> jsonschema.Validator:
    """The CRD's openAPIV3Schema as a JSON Schema validator.

    It is OpenAPI 3.0 (boolean exclusiveMinimum/Maximum, as in draft 4); the Kubernetes
    extensions (x-kubernetes-int-or-string, nullable) are left to the API server: they only
    widen what is accepted, so this check is never stricter than Kubernetes.
    """
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def example_pools(helm: Helm) -> list[tuple[str, dict[str, Any]]]:
    pools = [("examples/pool.yaml", yaml.safe_load((EXAMPLES / "pool.yaml").read_text()))]
    rendered = helm.template(sets=["examplePool.enabled=true"])
    pools += [("values.yaml examplePool", one(rendered, "MooncakeKVPool"))]
    for path in sorted(EXAMPLES.glob("*-values.yaml")):
        pools += [(path.name, pool) for pool in of_kind(helm.template(path), "MooncakeKVPool")]
    return pools


def test_helm_uninstall_keeps_the_example_pool(helm: Helm) -> None:
    """Removed with the operator, the pool's finalizer would wait for an operator that is gone."""
    pool = one(helm.template(sets=["examplePool.enabled=true"]), "MooncakeKVPool")
    assert pool["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_example_pools_validate_against_the_crd_and_the_operator(helm: Helm) -> None:
    validator = crd_validator()
    pools = example_pools(helm)
    assert len(pools) >= 3, [name for name, _ in pools]
    for name, pool in pools:
        errors = sorted(validator.iter_errors(pool), key=str)
        assert not errors, f"{name}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors)
        assert pool["apiVersion"] == "kvpool.mooncake.io/v1alpha1" and pool["kind"] == "MooncakeKVPool"
        # What the webhook and the ConfigValid condition would say: nothing.
        meta = pool["metadata"]
        _, _, problems = validation.validate(meta["name"], meta.get("namespace", "default"), pool["spec"])
        assert problems == [], f"{name}: {validation.describe(problems)}"


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("spec", "store", "mode"), "shared"),
        (("spec", "master", "replicas"), 0),
        (("spec", "consumers", 0, "layout", "groups"), []),
        # spec.image is optional since external pools (the operator requires it otherwise).
        (("spec", "consumers", 0, "layout"), None),
        (("spec", "store", "diskTier"), {"capacity": "1GB", "volume": {"type": "hostPath"}}),
    ],
)
def test_the_crd_check_bites(path: tuple[Any, ...], value: Any) -> None:
    pool = copy.deepcopy(yaml.safe_load((EXAMPLES / "pool.yaml").read_text()))
    node = pool
    for key in path[:-1]:
        node = node[key]
    if value is None:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    assert list(crd_validator().iter_errors(pool))


@pytest.mark.parametrize(
    "crd", [build_crd(), build_grant_crd()], ids=lambda crd: crd["spec"]["names"]["kind"]
)
def test_the_readmes_kubectl_get_shows_the_crds_columns(crd: dict[str, Any]) -> None:
    """The chart README's ``kubectl get <short name>`` samples head the columns the CRD prints."""
    short = crd["spec"]["names"]["shortNames"][0]
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    expected = ["NAME"] + [c["name"].upper() for c in columns if not c.get("priority")]
    lines = (CHART / "README.md").read_text().splitlines()
    samples = [
        lines[i + 1] for i, line in enumerate(lines) if re.match(rf"\$ kubectl get {short}( -n \S+)?$", line)
    ]
    assert samples, f"no `kubectl get {short}` sample in the chart README"
    for header in samples:
        assert re.split(r" {2,}", header.strip()) == expected
