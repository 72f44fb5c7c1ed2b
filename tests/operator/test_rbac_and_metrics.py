"""RBAC rules, metric names, quantities, CLI, imports."""

from __future__ import annotations

import pytest
import yaml

from kvpool.operator import metric_names, metrics
from kvpool.operator.cli import _parser, main, options_from_args
from kvpool.operator.generated import RBAC_RULES_PATH, TENANT_RULES_PATHS, generated_files
from kvpool.operator.policy import CONTROL_PLANE_KEYS
from kvpool.operator.rbac import RULES, WEBHOOK_RULES, Permission, allowed, request_permission
from kvpool.operator.spec import format_bytes, parse_quantity


@pytest.mark.parametrize(
    ("method", "url", "expected"),
    [
        (
            "GET",
            "/apis/kvpool.mooncake.io/v1alpha1/mooncakekvpools?watch=true",
            Permission("kvpool.mooncake.io", "mooncakekvpools", "watch"),
        ),
        (
            "GET",
            "/apis/kvpool.mooncake.io/v1alpha1/mooncakekvpools",
            Permission("kvpool.mooncake.io", "mooncakekvpools", "list"),
        ),
        (
            "PATCH",
            "/apis/kvpool.mooncake.io/v1alpha1/namespaces/a/mooncakekvpools/p/status",
            Permission("kvpool.mooncake.io", "mooncakekvpools/status", "patch"),
        ),
        (
            "GET",
            "/apis/apps/v1/namespaces/a/deployments?labelSelector=x",
            Permission("apps", "deployments", "list"),
        ),
        ("DELETE", "/api/v1/namespaces/a/configmaps/c", Permission("", "configmaps", "delete")),
        ("POST", "/api/v1/namespaces/a/events", Permission("", "events", "create")),
        ("GET", "/apis", None),
        ("GET", "/api/v1", None),
        ("GET", "/apis/apps/v1", None),
    ],
)
def test_requests_map_to_permissions(method: str, url: str, expected: Permission | None) -> None:
    assert request_permission(method, url) == expected


def test_rules_have_no_wildcards_and_grant_what_they_say() -> None:
    for rule in RULES + WEBHOOK_RULES:
        assert "*" not in rule.verbs and "*" not in rule.resources and rule.api_group != "*"
    assert allowed(Permission("apps", "deployments", "patch"))
    assert allowed(Permission("", "secrets", "get")) is None
    assert allowed(Permission("kvpool.mooncake.io", "mooncakekvpools", "delete")) is None


def test_cli_prints_rbac_as_the_chart_ships_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rbac"]) == 0
    printed = capsys.readouterr().out
    assert yaml.safe_load(printed) == [r.as_dict() for r in RULES]
    assert printed == generated_files()[RBAC_RULES_PATH]
    assert main(["rbac", "--webhook-managed"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == [r.as_dict() for r in RULES + WEBHOOK_RULES]
    for role, path in TENANT_RULES_PATHS.items():
        assert main(["rbac", "--tenant", role]) == 0
        assert capsys.readouterr().out == generated_files()[path]


def test_cli_run_options() -> None:
    args = _parser().parse_args(
        ["run", "-n", "a", "-n", "b", "--metrics-port", "0", "--liveness", "", "--webhook-port", "9443"]
    )
    config = options_from_args(args)
    assert config.namespaces == ("a", "b")
    assert config.metrics_port is None and config.liveness_endpoint is None
    assert config.webhook is not None and config.webhook.port == 9443


def test_metric_names_are_unique_and_registered() -> None:
    names = [m.name for m in metric_names.ALL]
    assert len(names) == len(set(names)) == len(metric_names.BY_NAME)
    assert all(n.startswith(metric_names.PREFIX) for n in names)
    families = {f.name: f.type for f in metrics.OperatorMetrics().registry.collect()}
    for spec in metric_names.ALL:
        assert families.get(spec.name) == spec.kind.value, spec.name


def test_names_import_no_prometheus_client() -> None:
    import subprocess
    import sys

    code = "import sys, kvpool.operator.metric_names; assert 'prometheus_client' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_operator_imports_neither_vllm_nor_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, kvpool.operator.app, kvpool.operator.cli; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pool_gauges_follow_status() -> None:
    m = metrics.OperatorMetrics()

    def sample(spec: metric_names.MetricSpec, **labels: str) -> float | None:
        return m.registry.get_sample_value(spec.exported, labels)

    status = {
        "conditions": [{"type": "ConfigValid", "status": "True"}],
        "consumers": [{"rolledOut": True}, {"rolledOut": False}],
    }
    m.observe_pool("a", "p", status)
    assert sample(metric_names.POOLS, condition="ConfigValid", status="True") == 1
    assert sample(metric_names.CONSUMERS_ROLLED_OUT, namespace="a", pool="p") == 1
    assert sample(metric_names.CONSUMERS, namespace="a", pool="p") == 2
    m.forget_pool("a", "p")
    assert sample(metric_names.POOLS, condition="ConfigValid", status="True") == 0
    assert sample(metric_names.CONSUMERS, namespace="a", pool="p") is None


@pytest.mark.parametrize(
    ("spec", "mode"),
    [
        ({"image": "mooncake:1", "store": {"replicas": 2}}, "managed"),
        ({"image": "mooncake:1", "store": {"mode": "embedded"}}, "embedded"),
        ({"external": {"masterServerAddress": "m:50051"}}, "external"),
        ({"external": {"masterServerAddress": "m:50051"}, "store": {"mode": "embedded"}}, "external"),
        (None, "managed"),
    ],
)
def test_the_pool_info_gauge_names_each_pools_mode(spec: dict | None, mode: str) -> None:
    m = metrics.OperatorMetrics()

    def info(namespace: str, pool: str, mode: str) -> float | None:
        labels = {"namespace": namespace, "pool": pool, "mode": mode}
        return m.registry.get_sample_value(metric_names.POOL_INFO.exported, labels)

    m.observe_pool("a", "p", {"phase": "Ready"}, metrics.pool_mode(spec))
    assert info("a", "p", mode) == 1
    m.observe_pool("a", "p", {"phase": "Error"})  # no mode: the last one stays
    assert info("a", "p", mode) == 1
    m.forget_pool("a", "p")
    assert info("a", "p", mode) is None


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("8Gi", 8 << 30),
        ("500M", 500_000_000),
        ("1e3", 1000),
        ("100m", 0.1),
        (512, 512),
        ("1.5Gi", 3 << 29),
    ],
)
def test_quantities(text: str | int, value: float) -> None:
    assert float(parse_quantity(text)) == pytest.approx(value)


def test_bad_quantities_and_formatting() -> None:
    with pytest.raises(ValueError):
        parse_quantity("8 gigs")
    assert format_bytes(5 << 29) == "2560Mi"
    assert format_bytes(1000) == "1000"


def test_children_with_block_owner_deletion_need_the_pools_finalizers() -> None:
    from kvpool.operator.rbac import implied_permissions

    body = {
        "metadata": {
            "ownerReferences": [
                {
                    "apiVersion": "kvpool.mooncake.io/v1alpha1",
                    "kind": "MooncakeKVPool",
                    "name": "pool",
                    "uid": "u",
                    "blockOwnerDeletion": True,
                }
            ]
        }
    }
    (needed,) = implied_permissions("POST", body)
    assert needed == Permission("kvpool.mooncake.io", "mooncakekvpools/finalizers", "update")
    assert allowed(needed) is not None
    assert implied_permissions("GET", body) == []
    assert implied_permissions("PATCH", {"metadata": {"labels": {}}}) == []


def test_cli_policy_options() -> None:
    args = _parser().parse_args(
        [
            "run",
            "--allowed-registry",
            "registry.internal/mooncake",
            "--allowed-priority-class",
            "kv-cache",
            "--allowed-toleration-key",
            "gpu",
            "--protected-node-key",
            "example.com/infra",
            "--allow-network-policy-opt-out",
            "--no-network-policy-end-port",
            "--max-store-replicas",
            "8",
            "--operator-namespace",
            "kvpool-system",
            "--operator-pod-label",
            "app.kubernetes.io/name=mooncake-kvpool",
            "--master-health-url",
            "http://127.0.0.2:{port}/health",
        ]
    )
    config = options_from_args(args)
    assert config.policy.allowed_registries == ("registry.internal/mooncake",)
    assert config.policy.allowed_priority_classes == ("kv-cache",)
    assert config.policy.allowed_toleration_keys == ("gpu",)
    assert config.policy.protected_keys == (*CONTROL_PLANE_KEYS, "example.com/infra")
    assert config.policy.allow_network_policy_opt_out and not config.policy.network_policy_end_port
    default = options_from_args(_parser().parse_args(["run"])).policy
    assert not default.allow_network_policy_opt_out and default.network_policy_end_port
    with pytest.raises(SystemExit, match="not a registry"):
        options_from_args(_parser().parse_args(["run", "--allowed-registry", "registry.internal/x:1"]))
    assert (config.policy.max_store_replicas, config.policy.max_master_replicas) == (8, None)
    assert config.policy.operator_namespace == "kvpool-system"
    assert config.policy.operator_pod_labels == (("app.kubernetes.io/name", "mooncake-kvpool"),)
    assert config.master_health_url == "http://127.0.0.2:{port}/health"
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        options_from_args(_parser().parse_args(["run", "--operator-pod-label", "novalue"]))


def test_the_lease_rules_name_the_operators_lease_only() -> None:
    """Another controller's Lease in the operator's namespace is out of reach (but for a
    create, which RBAC cannot limit by name)."""
    from kvpool.operator.names import LEASE_NAME
    from kvpool.operator.rbac import LEASE_RULES

    path = "/apis/coordination.k8s.io/v1/namespaces/ops/leases"
    for method in ("GET", "PATCH"):
        own = request_permission(method, f"{path}/{LEASE_NAME}")
        theirs = request_permission(method, f"{path}/another-controller")
        assert own is not None and allowed(own, LEASE_RULES)
        assert theirs is not None and not allowed(theirs, LEASE_RULES)
    create = request_permission("POST", path)
    assert create is not None and allowed(create, LEASE_RULES)
