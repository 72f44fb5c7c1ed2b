"""Grants on real Mooncake processes: a master started with the tenancy flags and the quota
policy the operator renders from two grants that oversubscribe the pool cuts them as the
grants' status says, and refuses each tenant's writes past its cut quota (loopback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.contract.tenant_policy import POLICY_FILE
from kvpool.connector.local.pool import LocalPool
from kvpool.connector.pool_client import CODE_TENANT_QUOTA_EXCEEDED, open_client
from kvpool.operator.grants import grant_status, read_grant
from kvpool.operator.plan import build_plan
from testing.kube_api import NAMESPACE
from testing.operator_objects import consumer, pool_spec

pytestmark = pytest.mark.mooncake

MIB = 1 << 20
TENANCY_FLAGS = ("--enable_multi_tenants", "--tenant_quota_connector_type")


def test_the_master_enforces_the_cut_the_grants_status_reports(tmp_path: Path) -> None:
    grants = [
        read_grant(
            {"metadata": {"name": n, "namespace": NAMESPACE}, "spec": {"pool": "pool", "ceiling": "24MB"}}
        )
        for n in ("team-a", "team-b")
    ]
    raw = pool_spec(
        tenancy={"enabled": True},
        store={"segmentSize": "32MB", "replicas": 1},
        consumers=[{**consumer(), "name": f"llm-{g.name}", "grant": g.name} for g in grants],
    )
    plan = build_plan("pool", NAMESPACE, raw, grants=grants)
    assert plan.problems == [] and plan.tenancy is not None
    objs = {f"{c['kind']}/{c['metadata']['name']}": c for c in plan.children}
    # The master's rendered flags, the policy file where the ConfigMap is mounted (here: a file).
    policy = tmp_path / POLICY_FILE
    policy.write_text(objs["ConfigMap/pool-tenants"]["data"][POLICY_FILE])
    (master,) = objs["Deployment/pool-master"]["spec"]["template"]["spec"]["containers"]
    flags = tuple(a for a in master["args"] if a.startswith(TENANCY_FLAGS))
    flags += (f"--tenant_quota_connector_uri={policy}",)
    assert len(flags) == 3

    with LocalPool(segment_size="32MB", master_args=flags) as pool:
        assert pool.master is not None
        admitted = {tenant: q.effective for tenant, q in pool.master.tenant_quotas().items()}
        assert admitted == plan.tenancy.effective == {t: 16 * MIB for t in plan.tenancy.requested}
        for grant in grants:
            assert grant_status(grant, plan.tenancy)["ceilingBytes"] == 16 * MIB
        for injection in plan.consumers:
            extra = json.loads(injection.kv_transfer_config)["kv_connector_extra_config"]
            settings = ConnectorSettings.parse(
                {"master_server_address": pool.address, "tenant": extra["tenant"], "cache_prefix": "t"}
            )
            client = open_client(settings, global_segment_size=0)
            try:
                keys = [f"k{i}" for i in range(24)]
                codes = client.reserve(keys, [MIB] * len(keys))
                taken = sum(1 for c in codes if c == 0)
                assert 0 < taken <= 16, codes
                assert set(codes[taken:]) == {CODE_TENANT_QUOTA_EXCEEDED}, codes
                assert pool.master.tenant_quotas()[settings.tenant].charged <= 16 * MIB
            finally:
                client.close()
