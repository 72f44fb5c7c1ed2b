"""Monitoring objects: what they select is what the operator creates, what they scrape is
what it serves; dashboards and alert rules come from the chart's files/ (written by the
dashboards generator) and render to nothing while those files are absent.

The prometheus-operator kinds have no offline schema here (see test_chart_render), so their
fields are checked one by one, and the alert rules go through ``promtool check rules``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool.connector.contract.metric_names import VLLM_NAME_RELABEL
from kvpool.operator import names
from kvpool.operator.consumers import injected
from kvpool.operator.metrics import METRICS_PATH
from kvpool.operator.plan import build_plan
from testing.operator_objects import vllm_deployment
from tests.chart.helm import CHART, EXAMPLES, NAMESPACE, Helm, of_kind, one

MONITORING = EXAMPLES / "monitoring-values.yaml"
DASHBOARDS = "files/dashboards"
ALERTS = "files/alerts.yaml"
MONITOR_KINDS = ("ServiceMonitor", "PodMonitor", "PrometheusRule")

PLACEHOLDER_RULES = """\
groups:
  - name: kvpool-placeholder
    rules:
      - alert: KVPoolPlaceholderMasterDown
        expr: up{job="pool-master"} == 0
        for: 5m
        labels:
          severity: critical
        annotations:
          summary: 'Mooncake master of pool {{ $labels.pool }} is down'
"""


# The job names the dashboards and alert rules select by (dashboards/conventions.py).
MASTER_JOB = "mooncake-master"
OPERATOR_JOB = "kvpool-operator"


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not ok:
            return False
    return True


def meta_label(kind: str, label: str) -> str:
    """Prometheus' Kubernetes service-discovery name of an object's label."""
    return f"__meta_kubernetes_{kind}_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)


def camel(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(part.title() for part in rest)


@pytest.fixture(scope="module")
def pool() -> dict[str, Any]:
    """What the operator builds for examples/pool.yaml: its children and a consumer it patched."""
    manifest = yaml.safe_load((EXAMPLES / "pool.yaml").read_text())
    meta = manifest["metadata"]
    plan = build_plan(meta["name"], meta["namespace"], manifest["spec"])
    assert plan.valid, plan.problems
    consumer = vllm_deployment(plan.consumers[0].deployment)
    return {
        "children": plan.children,
        "consumer": injected(consumer, plan.consumers[0]),
        "unpatched": consumer,
    }


def test_nothing_by_default(helm: Helm) -> None:
    objects = helm.template()
    assert not [o for o in objects if o["kind"] in MONITOR_KINDS]
    assert of_kind(objects, "ConfigMap") == []


def test_the_operators_service_monitor(helm: Helm) -> None:
    objects = helm.template(MONITORING)
    monitor = one(objects, "ServiceMonitor", "kvpool-mooncake-kvpool")
    service = one(objects, "Service")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert selects(monitor["spec"]["selector"], service["metadata"]["labels"])
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [service["metadata"]["namespace"]]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == METRICS_PATH
    # The operator's per-pool gauges carry namespace and pool labels of their own.
    assert endpoint["honorLabels"] is True
    assert endpoint["relabelings"] == [
        {"targetLabel": "job", "replacement": OPERATOR_JOB, "action": "replace"}
    ]


def test_the_pool_masters_service_monitor(helm: Helm, pool: dict[str, Any]) -> None:
    monitor = one(helm.template(MONITORING), "ServiceMonitor", "kvpool-mooncake-kvpool-pool-masters")
    services = [c for c in pool["children"] if c["kind"] == "Service"]
    selected = [s for s in services if selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
    assert [s["metadata"]["name"] for s in selected] == [names.master_name("kvpool")]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in selected[0]["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    pool_label, job = endpoint["relabelings"]
    # The pool's name comes from the master pods' label (the Service's endpoints are its pods).
    master = next(c for c in pool["children"] if c["metadata"]["name"] == names.master_name("kvpool"))
    assert master["kind"] == "Deployment"
    assert master["spec"]["template"]["metadata"]["labels"][names.LABEL_POOL] == "kvpool"
    assert pool_label["sourceLabels"] == [meta_label("pod", names.LABEL_POOL)]
    assert pool_label["targetLabel"] == "pool"
    assert job == {"targetLabel": "job", "replacement": MASTER_JOB, "action": "replace"}
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}  # the watched ones
    everywhere = one(
        helm.template(MONITORING, sets=["clusterWide=true"]), "ServiceMonitor", monitor["metadata"]["name"]
    )
    assert everywhere["spec"]["namespaceSelector"] == {"any": True}


def test_the_consumers_pod_monitor(helm: Helm, pool: dict[str, Any]) -> None:
    monitor = one(helm.template(MONITORING), "PodMonitor")
    selector = monitor["spec"]["selector"]
    consumer_pod = pool["consumer"]["spec"]["template"]["metadata"]["labels"]
    assert selects(selector, consumer_pod)
    assert not selects(selector, pool["unpatched"]["spec"]["template"]["metadata"]["labels"])
    for child in pool["children"]:
        if child["kind"] == "Deployment":  # the pool's own master and store pods
            assert not selects(selector, child["spec"]["template"]["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("http", "/metrics", "15s")
    (pool_label,) = endpoint["relabelings"]
    assert pool_label["sourceLabels"] == [meta_label("pod", names.LABEL_POOL)]
    assert pool_label["targetLabel"] == "pool"


def test_the_vllm_name_rule_is_the_connectors(helm: Helm) -> None:
    (endpoint,) = one(helm.template(MONITORING), "PodMonitor")["spec"]["podMetricsEndpoints"]
    (rule,) = endpoint["metricRelabelings"]
    assert rule == {camel(key): value for key, value in VLLM_NAME_RELABEL.items()}


def test_namespaced_monitors_look_only_where_the_operator_works(helm: Helm) -> None:
    objects = helm.template(MONITORING, sets=["clusterWide=false", "watchNamespaces={team-a,team-b}"])
    for monitor in (
        one(objects, "ServiceMonitor", "kvpool-mooncake-kvpool-pool-masters"),
        one(objects, "PodMonitor"),
    ):
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


def test_what_the_chart_ships(helm: Helm) -> None:
    """Whatever files/ holds now: one ConfigMap per dashboard, the rules when there are any."""
    objects = helm.template(MONITORING)
    dashboards = sorted((CHART / DASHBOARDS).glob("*.json"))
    assert len(of_kind(objects, "ConfigMap")) == len(dashboards)
    alerts = CHART / ALERTS
    groups = (yaml.safe_load(alerts.read_text()) or {}).get("groups") if alerts.exists() else None
    assert len(of_kind(objects, "PrometheusRule")) == (1 if groups else 0)


@pytest.fixture
def with_files(chart_copy: Path) -> Path:
    """The chart with dashboards and rules: the generator's, or placeholders until it has run."""
    dashboards = chart_copy / DASHBOARDS
    if not list(dashboards.glob("*.json")):
        dashboards.mkdir(parents=True, exist_ok=True)
        for name in ("kvpool-connector", "kvpool_pool"):
            (dashboards / f"{name}.json").write_text(json.dumps({"title": name, "uid": name, "panels": []}))
    alerts = chart_copy / ALERTS
    if not alerts.exists():
        alerts.write_text(PLACEHOLDER_RULES)
    return chart_copy


def test_dashboards_become_sidecar_config_maps(helm: Helm, with_files: Path) -> None:
    objects = helm.template(MONITORING, chart=with_files)
    maps = of_kind(objects, "ConfigMap")
    files = sorted((with_files / DASHBOARDS).glob("*.json"))
    assert len(maps) == len(files) >= 1
    shipped = {}
    for config_map in maps:
        meta = config_map["metadata"]
        assert meta["labels"]["grafana_dashboard"] == "1"
        assert meta["namespace"] == "monitoring"
        assert meta["annotations"] == {"grafana_folder": "KV cache"}
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", meta["name"]) and len(meta["name"]) <= 63
        shipped.update(config_map["data"])
    assert sorted(shipped) == [f.name for f in files]
    for file in files:
        assert json.loads(shipped[file.name]) == json.loads(file.read_text())


def test_the_alert_rules_become_a_prometheus_rule(helm: Helm, with_files: Path, tmp_path: Path) -> None:
    objects = helm.template(MONITORING, chart=with_files)
    rule = one(objects, "PrometheusRule")
    assert rule["metadata"]["namespace"] == NAMESPACE
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    expected = yaml.safe_load((with_files / ALERTS).read_text())["groups"]
    assert rule["spec"]["groups"] == expected  # alert templates ({{ $labels.x }}) pass through untouched
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian package prometheus, installed by scripts/setup.sh) is not here")
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rule["spec"]))
    checked = subprocess.run(
        [promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_missing_files_render_nothing(helm: Helm, chart_copy: Path) -> None:
    shutil.rmtree(chart_copy / DASHBOARDS, ignore_errors=True)
    (chart_copy / ALERTS).unlink(missing_ok=True)
    objects = helm.template(MONITORING, chart=chart_copy)
    assert of_kind(objects, "ConfigMap") == of_kind(objects, "PrometheusRule") == []
    (chart_copy / ALERTS).write_text("groups: []\n")
    assert of_kind(helm.template(MONITORING, chart=chart_copy), "PrometheusRule") == []
    notes = helm.notes(MONITORING, chart=chart_copy)
    assert "ships no dashboards" in notes and "ships no alert rules" not in notes


def test_broken_rules_file_fails_the_render(helm: Helm, chart_copy: Path) -> None:
    (chart_copy / "files").mkdir(exist_ok=True)
    (chart_copy / ALERTS).write_text("groups: [\n")
    result = helm.run("template", "kvpool", str(chart_copy), "-f", str(MONITORING), check=False)
    assert result.returncode != 0 and "files/alerts.yaml is not valid YAML" in result.stderr


def test_the_labels_are_what_the_dashboards_expect() -> None:
    """The monitors produce the labels the generated dashboards and alert rules select by."""
    conventions = pytest.importorskip("dashboards.conventions", reason="the dashboards generator is not here")
    assert (conventions.MASTER_JOB, conventions.OPERATOR_JOB) == (MASTER_JOB, OPERATOR_JOB)
    assert conventions.POOL == "pool" and conventions.NAMESPACE == "namespace"
    assert conventions.POOL_POD_LABEL == names.LABEL_POOL
