"""Validation: the contract's rules for layouts and settings, the operator's own for the pool."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvpool.connector.contract.layout import KVLayout, check
from kvpool.operator.plan import build_plan
from kvpool.operator.status import condition_of, invalid_status
from kvpool.operator.validation import admission_problems
from testing.operator_objects import full_group, layout, pool_manifest, pool_spec


def problems(raw: dict[str, Any], pool: str = "pool") -> list[tuple[str, str]]:
    return [(p.field, p.rule) for p in build_plan(pool, "ns", raw).problems]


def with_consumer_layout(groups: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    raw = pool_spec()
    raw["consumers"][0]["layout"] = layout(*groups, **extra)
    return raw


def test_a_good_spec_has_no_problems() -> None:
    assert problems(pool_spec()) == []


@pytest.mark.parametrize(
    ("groups", "extra", "expected"),
    [
        (
            [full_group(), {"kind": "cross", "block_size": 16}],
            {},
            ("spec.consumers[0].layout.groups[1].kind", "cross-attention"),
        ),
        (
            [full_group(), {"kind": "mamba", "block_size": 16, "mamba_cache_mode": "all"}],
            {},
            ("spec.consumers[0].layout.groups[1].mamba_cache_mode", "mamba-align"),
        ),
        (
            [full_group(), {"kind": "sliding_window", "block_size": 16, "sliding_window": 128}],
            {"dcp_size": 2},
            ("spec.consumers[0].layout.dcp_size", "hybrid-context-parallel"),
        ),
        (
            [full_group()],
            {"pcp_size": 2},
            ("spec.consumers[0].layout.pcp_size", "prefill-context-parallel"),
        ),
        (
            [full_group()],
            {"tp_size": 4, "kv_shards": 3},
            ("spec.consumers[0].layout.kv_shards", "kv-shards-divide-tp"),
        ),
        (
            [{"kind": "sliding_window", "block_size": 16}],
            {},
            ("spec.consumers[0].layout.groups[0].sliding_window", "window-required"),
        ),
    ],
)
def test_layouts_go_through_the_contracts_check(
    groups: list[dict[str, Any]], extra: dict[str, Any], expected: tuple[str, str]
) -> None:
    raw = with_consumer_layout(groups=groups, **extra)
    assert expected in problems(raw)
    # The same rule set as the connector's own: one problem per contract problem.
    contract = check(KVLayout.model_validate(raw["consumers"][0]["layout"]))
    assert {p.rule for p in contract} == {rule for _, rule in problems(raw)}


def test_a_declaration_that_leaves_out_what_vllm_always_builds_is_refused() -> None:
    """No layout vLLM builds has dtype ``auto``, no model, no cache block size or a group
    without its page size: such a declaration would keep every engine out of the pool, so
    the pool is refused, naming each field, and nothing is built."""
    raw = pool_spec()
    raw["consumers"][0]["layout"] = {"model": "", "groups": [{"kind": "full", "block_size": 16}]}
    plan = build_plan("pool", "ns", raw)
    assert sorted((p.field, p.rule) for p in plan.problems) == [
        ("spec.consumers[0].layout.cache_block_size", "declared-layout-incomplete"),
        ("spec.consumers[0].layout.dtype", "declared-layout-incomplete"),
        ("spec.consumers[0].layout.groups[0].page_size_bytes", "declared-layout-incomplete"),
        ("spec.consumers[0].layout.model", "declared-layout-incomplete"),
    ]
    assert "kvpool-layout prints" in str(plan.problems[0])
    assert plan.children == [] and plan.consumers == []


def test_messages_name_consumer_group_and_rule() -> None:
    raw = with_consumer_layout(groups=[full_group(), {"kind": "cross", "block_size": 16}])
    (problem,) = build_plan("pool", "ns", raw).problems
    text = str(problem)
    assert "spec.consumers[0].layout.groups[1].kind" in text
    assert "consumer 'llm'" in text
    assert "[cross-attention]" in text


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"master": {"replicas": 2}}, ("spec.master.replicas", "single-master")),
        (
            {"master": {"replicas": 1, "ha": {"enabled": True, "etcdEndpoints": ["e:2379"]}}},
            ("spec.master.replicas", "ha-replicas"),
        ),
        ({"master": {"replicas": 2, "ha": {"enabled": True}}}, ("spec.master.ha.etcdEndpoints", "ha-etcd")),
        ({"master": {"rpcPort": 9003}}, ("spec.master.metricsPort", "port-conflict")),
        # Inside Mooncake's transfer ports, opened to granted consumers: never the admin API.
        ({"master": {"metricsPort": 15500}}, ("spec.master.metricsPort", "transfer-port-range")),
        ({"master": {"rpcPort": 17000}}, ("spec.master.rpcPort", "transfer-port-range")),
        ({"store": {"port": 15000}}, ("spec.store.port", "transfer-port-range")),
        ({"store": {"replicas": 0}}, ("spec.store.replicas", "store-replicas")),
        (
            {"store": {"segmentSize": "8GB", "resources": {"limits": {"memory": "6Gi"}}}},
            ("spec.store.resources.limits.memory", "store-memory"),
        ),
        ({"store": {"protocol": "rdma"}}, ("spec.store.rdmaDevices", "connector-settings")),
        (
            {"connector": {"cache_prefix": "no spaces"}},
            ("spec.connector.cache_prefix", "schema:string_pattern_mismatch"),
        ),
        ({"master": {"rpcPort": "x"}}, ("spec.master.rpcPort", "schema:int_parsing")),
        # An endpoint's port is 1-65535: a NetworkPolicy of port 0 or 99999 would be refused.
        (
            {"master": {"replicas": 2, "ha": {"enabled": True, "etcdEndpoints": ["etcd:99999"]}}},
            ("spec.master.ha.etcdEndpoints[0]", "schema:string_pattern_mismatch"),
        ),
        (
            {"master": {"replicas": 2, "ha": {"enabled": True, "etcdEndpoints": ["e:2379", "etcd:0"]}}},
            ("spec.master.ha.etcdEndpoints[1]", "schema:string_pattern_mismatch"),
        ),
        ({"store": {"mode": "shared"}}, ("spec.store.mode", "schema:literal_error")),
        ({"surprise": 1}, ("spec.surprise", "schema:extra_forbidden")),
        (
            {"store": {"resources": {"limits": {"memory": "lots"}}}},
            ("spec.store.resources.limits.memory", "schema:value_error"),
        ),
    ],
)
def test_pool_rules(overrides: dict[str, Any], expected: tuple[str, str]) -> None:
    assert expected in problems(pool_spec(**overrides))


def test_memory_limit_that_holds_the_segment_is_fine() -> None:
    assert problems(pool_spec(store={"segmentSize": "4GB", "resources": {"limits": {"memory": "5Gi"}}})) == []


def test_duplicate_consumers_and_long_names() -> None:
    raw = pool_spec()
    raw["consumers"].append(dict(raw["consumers"][0]))
    assert ("spec.consumers[1].name", "consumer-unique") in problems(raw)
    assert ("metadata.name", "name-length") in problems(pool_spec(), pool="p" * 60)


def test_an_invalid_plan_builds_nothing() -> None:
    plan = build_plan("pool", "ns", pool_spec(master={"replicas": 2}))
    assert not plan.valid
    assert plan.children == [] and plan.consumers == [] and plan.absent == []


def test_the_webhook_uses_the_same_messages() -> None:
    raw = with_consumer_layout(groups=[full_group(), {"kind": "cross", "block_size": 16}])
    message = admission_problems(pool_manifest(spec=raw))
    assert message == str(build_plan("pool", "team-a", raw).problems[0])
    assert admission_problems(pool_manifest()) is None


@pytest.mark.parametrize(
    ("connector", "field"),
    [
        ({"metadata_server": ""}, "spec.connector.metadata_server"),
        ({"metadata_server": "   "}, "spec.connector.metadata_server"),
        ({"batch_size": True}, "spec.connector.batch_size"),
        ({"idle_step_wait_s": True}, "spec.connector.idle_step_wait_s"),
        ({"load_batch_bytes": "0.5"}, "spec.connector.load_batch_bytes"),
    ],
)
def test_connector_settings_the_contract_refuses_leave_the_pool_invalid(
    connector: dict[str, Any], field: str
) -> None:
    """No store pod gets ``--metadata_server=``: the spec is ConfigValid=False, naming the field."""
    raw = pool_spec(connector=connector)
    plan = build_plan("pool", "ns", raw)
    assert [p.field for p in plan.problems] == [field]
    assert plan.children == [] and plan.consumers == []
    status = invalid_status(plan.problems, {}, 1, "t1")
    valid = condition_of(status, "ConfigValid")
    assert valid["status"] == "False" and field in valid["message"]
    assert admission_problems(pool_manifest(spec=raw)) == str(plan.problems[0])


def test_webhook_lets_metadata_updates_and_deletions_through() -> None:
    from kvpool.operator.app import spec_changed

    pool = pool_manifest()
    assert spec_changed(None, pool)
    assert not spec_changed(pool, {**pool, "metadata": {**pool["metadata"], "finalizers": []}})
    changed = {**pool, "spec": {**pool["spec"], "image": "other:1"}}
    assert spec_changed(pool, changed)
    deleting = {**changed, "metadata": {**pool["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    assert not spec_changed(pool, deleting)


def test_a_store_limit_must_hold_the_segment_and_the_clients_overhead() -> None:
    raw = pool_spec(store={"segmentSize": "4GB", "resources": {"limits": {"memory": "4Gi"}}})
    (problem,) = build_plan("pool", "ns", raw).problems
    assert str(problem) == (
        "spec.store.resources.limits.memory: memory limit 4Gi cannot hold the 4Gi segment plus the "
        "client's 512Mi overhead: set at least 4608Mi [store-memory]"
    )
    enough = {"segmentSize": "4GB", "resources": {"limits": {"memory": "4608Mi"}}}
    assert problems(pool_spec(store=enough)) == []


def test_a_request_above_its_limit_is_refused() -> None:
    raw = pool_spec(master={"resources": {"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}})
    assert ("spec.master.resources.requests.memory", "request-over-limit") in problems(raw)


def test_a_store_request_above_the_limit_the_operator_sets_is_refused() -> None:
    """Without a memory limit the store gets segment + overhead as its limit: a larger request
    would be a Deployment the API server refuses on every write, so the spec is refused first."""
    raw = pool_spec(store={"segmentSize": "1GB", "resources": {"requests": {"memory": "8Gi"}}})
    (problem,) = build_plan("pool", "ns", raw).problems
    assert (problem.field, problem.rule) == ("spec.store.resources.requests.memory", "request-over-limit")
    assert "1536Mi" in str(problem) and "limits.memory" in str(problem)
    fits = {"segmentSize": "1GB", "resources": {"requests": {"memory": "1536Mi"}}}
    assert problems(pool_spec(store=fits)) == []
    with_limit = {
        "segmentSize": "1GB",
        "resources": {"requests": {"memory": "8Gi"}, "limits": {"memory": "8Gi"}},
    }
    assert problems(pool_spec(store=with_limit)) == []


def test_the_operators_policy_caps_images_and_replicas() -> None:
    from kvpool.operator.policy import OperatorPolicy

    policy = OperatorPolicy(
        allowed_registries=("registry.internal",), max_master_replicas=3, max_store_replicas=4
    )
    raw = pool_spec(
        image="docker.io/someone/mooncake:1",
        master={"replicas": 5, "ha": {"enabled": True, "etcdEndpoints": ["e:2379"]}},
        store={"segmentSize": "1GB", "replicas": 8},
    )
    found = {(p.field, p.rule): str(p) for p in build_plan("pool", "ns", raw, policy).problems}
    assert set(found) == {
        ("spec.image", "image-registry"),
        ("spec.master.replicas", "replica-cap"),
        ("spec.store.replicas", "replica-cap"),
    }
    assert "'registry.internal'" in found[("spec.image", "image-registry")]
    assert "8 replicas are above the operator's cap of 4" in found[("spec.store.replicas", "replica-cap")]
    assert admission_problems(pool_manifest(spec=raw), policy) is not None
    allowed = pool_spec(image="registry.internal/mooncake:1")
    assert build_plan("pool", "ns", allowed, policy).valid
    assert build_plan("pool", "ns", raw).valid  # no policy: no caps


def test_rdma_stores_warn_about_the_restricted_pod_security_standard() -> None:
    from kvpool.operator.validation import admission_warnings

    raw = pool_spec(store={"segmentSize": "1GB", "protocol": "rdma", "rdmaDevices": ["mlx5_0"]})
    plan = build_plan("pool", "ns", raw)
    assert plan.valid
    (warning,) = plan.warnings
    assert (warning.field, warning.rule) == ("spec.store.protocol", "pod-security-restricted")
    assert "IPC_LOCK" in warning.message and "restricted Pod Security Standard" in warning.message
    assert admission_warnings(pool_manifest(spec=raw)) == [str(warning)]
    assert build_plan("pool", "ns", pool_spec()).warnings == []


def test_a_lease_shorter_than_a_consumers_load_deadline_is_warned_about() -> None:
    """A read that outlasts its lease fails (``test_pool_faults.py`` shows it on a real
    master): below the consumers' load deadline, the pool is valid but said to lose hits."""
    from kvpool.operator.validation import CONSUMER_LOAD_TIMEOUT_S

    short = pool_spec(master={"leaseTtlMs": 1000})
    plan = build_plan("pool", "ns", short)
    assert plan.valid
    (warning,) = plan.warnings
    assert (warning.field, warning.rule) == ("spec.master.leaseTtlMs", "lease-shorter-than-load")
    assert "1000 ms" in warning.message and f"{CONSUMER_LOAD_TIMEOUT_S * 1000:g} ms" in warning.message
    at_deadline = pool_spec(master={"leaseTtlMs": int(CONSUMER_LOAD_TIMEOUT_S * 1000)})
    assert build_plan("pool", "ns", at_deadline).warnings == []


def external_spec(**external: Any) -> dict[str, Any]:
    raw = pool_spec(external={"masterServerAddress": "mooncake-master.shared.svc:50051", **external})
    del raw["image"], raw["store"]
    return raw


def test_an_external_pool_runs_nothing_and_needs_no_image() -> None:
    from kvpool.operator import names

    plan = build_plan("pool", "ns", external_spec(metricsEndpoints=["mooncake-master.shared.svc:9003"]))
    assert plan.problems == [] and plan.external and plan.observed
    assert [c["kind"] for c in plan.children] == ["ConfigMap"]
    assert (names.DEPLOYMENTS, "pool-master") in plan.absent and (
        names.DEPLOYMENTS,
        "pool-store",
    ) in plan.absent
    assert plan.master_address == "mooncake-master.shared.svc:50051"
    assert "mooncake-master.shared.svc:50051" in plan.consumers[0].kv_transfer_config
    assert [w.rule for w in plan.warnings] == ["external-network"]
    etcd = build_plan("pool", "ns", external_spec(masterServerAddress="etcd://e-0.etcd:2379,e-1.etcd:2379"))
    assert etcd.problems == [] and not etcd.observed  # no metricsEndpoints: nothing asked


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"master": {"replicas": 1}}, [("spec.master", "external-no-master")]),
        (
            {"store": {"replicas": 2, "mode": "embedded", "port": 1}},
            [
                ("spec.store.port", "external-no-store-pods"),
                ("spec.store.replicas", "external-no-store-pods"),
            ],
        ),
        (
            {"external": {"masterServerAddress": "m:50051", "metricsEndpoints": ["169.254.169.254:80"]}},
            [("spec.external.metricsEndpoints[0]", "external-address")],
        ),
        (
            {"external": {"masterServerAddress": "etcd://127.0.0.1:2379"}},
            [("spec.external.masterServerAddress", "external-address")],
        ),
        (
            {"external": {"masterServerAddress": "http://m/x"}},
            [("spec.external.masterServerAddress", "schema:string_pattern_mismatch")],
        ),
    ],
)
def test_an_external_pool_refuses_what_it_would_ignore(
    change: dict[str, Any], expected: list[tuple[str, str]]
) -> None:
    raw = {**external_spec(), **change}
    assert problems(raw) == expected


def test_a_pool_that_runs_its_master_needs_an_image_and_the_policy_may_forbid_external_pools() -> None:
    from kvpool.operator.policy import OperatorPolicy

    raw = pool_spec()
    del raw["image"]
    assert problems(raw) == [("spec.image", "image-required")]
    forbidden = build_plan("pool", "ns", external_spec(), OperatorPolicy(allow_external_pools=False))
    assert [(p.field, p.rule) for p in forbidden.problems] == [("spec.external", "external-pools-forbidden")]
    # Nothing was planned: an invalid spec changes nothing.
    assert forbidden.children == [] and forbidden.absent == []


def test_an_external_cluster_id_needs_an_etcd_address() -> None:
    assert problems(external_spec(clusterId="shared.pool")) == [
        ("spec.external.clusterId", "cluster-id-needs-etcd")
    ]
    plan = build_plan(
        "pool",
        "ns",
        external_spec(masterServerAddress="etcd://etcd.shared.svc:2379", clusterId="shared.pool"),
    )
    assert plan.problems == []
    kv = json.loads(plan.consumers[0].kv_transfer_config)
    assert kv["kv_connector_extra_config"]["cluster_id"] == "shared.pool"
