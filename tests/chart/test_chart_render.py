"""``helm lint --strict`` and ``helm template`` for the defaults and every example values file;
every rendered object passes kubernetes-validate's strict schemas; standard labels everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from kubernetes_validate.utils import SchemaNotFoundError

from tests.chart.helm import CHART, RELEASE, Helm, example_values

CASES = [pytest.param((), id="defaults")] + [pytest.param((path,), id=path.stem) for path in example_values()]
# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
# Kinds defined by other projects' CRDs: kubernetes-validate ships schemas of the built-in API
# only, and no offline schema of them exists here. MooncakeKVPool objects are validated against
# our CRD's own openAPIV3Schema instead (test_chart_crd); the monitoring objects are checked
# field by field against what they must select and scrape (test_chart_monitoring).
NO_OFFLINE_SCHEMA = {
    ("kvpool.mooncake.io/v1alpha1", "MooncakeKVPool"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("cert-manager.io/v1", "Issuer"),
    ("cert-manager.io/v1", "Certificate"),
}
STANDARD_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
)


def test_the_examples_are_there() -> None:
    names = {path.name for path in example_values()}
    assert {"namespaced-values.yaml", "monitoring-values.yaml", "example-pool-values.yaml"} <= names


@pytest.mark.parametrize("values", CASES)
def test_lint_strict_passes(helm: Helm, values: tuple[Path, ...]) -> None:
    result = helm.lint(*values)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout


@pytest.mark.parametrize("values", CASES)
def test_every_rendered_object_passes_strict_schemas(helm: Helm, values: tuple[Path, ...]) -> None:
    objects = helm.template(*values)
    assert {obj["kind"] for obj in objects} >= {"CustomResourceDefinition", "Deployment", "ServiceAccount"}
    checked = 0
    for version in KUBERNETES_VERSIONS:
        for obj in objects:
            what = f"{obj['kind']}/{obj['metadata']['name']} (Kubernetes {version})"
            try:
                kubernetes_validate.validate(obj, version, strict=True)
                checked += 1
            except SchemaNotFoundError:
                assert (obj["apiVersion"], obj["kind"]) in NO_OFFLINE_SCHEMA, f"no schema for {what}"
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path)
                pytest.fail(f"{what} is invalid at {path}: {exc.message}")
    assert checked >= 2 * 5


def test_the_cli_agrees(helm: Helm, tmp_path: Path) -> None:
    """The ``kubernetes-validate --strict`` console script, on the whole rendered default chart."""
    import subprocess
    import sys

    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(helm.run("template", RELEASE, str(CHART), "--include-crds").stdout)
    script = Path(sys.executable).parent / "kubernetes-validate"
    result = subprocess.run(
        [str(script), "--strict", "--quiet", str(rendered)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ERROR" not in result.stdout


def test_below_the_kube_version_floor_it_refuses(helm: Helm) -> None:
    ok = helm.run("template", RELEASE, str(CHART), "--kube-version", "1.30.0", check=False)
    assert ok.returncode == 0, ok.stderr
    old = helm.run("template", RELEASE, str(CHART), "--kube-version", "1.29.0", check=False)
    assert old.returncode != 0 and "kubeVersion" in old.stderr


def _labelled(obj: dict[str, Any]) -> list[tuple[str, dict[str, str]]]:
    found = [(f"{obj['kind']}/{obj['metadata']['name']}", obj["metadata"].get("labels") or {})]
    template = (obj.get("spec") or {}).get("template")
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet") and template:
        found.append((f"{found[0][0]} pod template", template["metadata"].get("labels") or {}))
    return found


@pytest.mark.parametrize("values", CASES)
def test_standard_labels_everywhere(helm: Helm, values: tuple[Path, ...]) -> None:
    templated = [o for o in helm.template(*values) if o["kind"] != "CustomResourceDefinition"]
    for obj in templated:
        for what, labels in _labelled(obj):
            missing = [key for key in STANDARD_LABELS if key not in labels]
            assert not missing, f"{what} lacks {missing}"
            assert labels["app.kubernetes.io/instance"] == RELEASE, what
            assert labels["app.kubernetes.io/managed-by"] == "Helm", what
            assert labels["app.kubernetes.io/part-of"] == "mooncake-kvpool", what


def test_names_follow_overrides(helm: Helm) -> None:
    objects = helm.template(sets=["fullnameOverride=kvp"])
    names = {o["metadata"]["name"] for o in objects if o["kind"] != "CustomResourceDefinition"}
    # The tenants' aggregated ClusterRoles too, and the finalizer ClusterRole (and its binding).
    assert names == {"kvp", "kvp-edit", "kvp-view", "kvp-finalizers"}
    named = helm.template(sets=["nameOverride=pool-operator"])
    assert {o["metadata"]["name"] for o in named if o["kind"] == "Deployment"} == {"kvpool-pool-operator"}
