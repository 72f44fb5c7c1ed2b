"""Grants on real Mooncake processes: a master started with the tenancy flags and the quota
policy the operator renders from two grants that oversubscribe the pool cuts them as the
grants' status says, and refuses each tenant's writes past its cut quota; the operator,
observing that master, shows each grant's usage as the master itself reports it (loopback)."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.contract.tenant_policy import POLICY_FILE
from kvpool.connector.local.pool import LocalPool
from kvpool.connector.local.tenant_quotas import TenantQuota
from kvpool.connector.pool_client import CODE_TENANT_QUOTA_EXCEEDED, open_client
from kvpool.operator.grants import grant_status, read_grant
from kvpool.operator.names import GRANTS
from kvpool.operator.plan import build_plan
from kvpool.operator.policy import OperatorPolicy
from testing.kube_api import DEPLOYMENTS_PATH, GRANTS_PATH, NAMESPACE, Cluster, eventually
from testing.operator_objects import Operator, consumer, pool_manifest, pool_spec
from testing.pool_store import put_bytes

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


# --- Usage per grant, observed from the real master -------------------------------------

OBSERVING = {
    "master_health_url": "http://127.0.0.1:{port}/health",
    "observe_interval": 0.3,
    "policy": OperatorPolicy(operator_namespace="kvpool-system", operator_pod_labels=(("app", "op"),)),
}


def grant_manifest(name: str, ceiling: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GRANTS.group}/{GRANTS.version}",
        "kind": GRANTS.kind,
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"pool": "pool", "ceiling": ceiling},
    }


def usage_matches(usage: dict[str, Any], own: TenantQuota, rejected: int) -> bool:
    return (
        usage.get("state") == "Observed"
        and usage.get("usedBytes") == own.charged
        and usage.get("quotaBytes") == own.effective
        and usage.get("requestedBytes") == own.requested
        and usage.get("rejectedWrites") == rejected
    )


@pytest.mark.timeout(120)
@pytest.mark.asyncio
@pytest.mark.parametrize("operator_config", [OBSERVING])
async def test_each_grants_usage_in_its_status_is_the_masters_own(
    cluster: Cluster, operator: Operator, held_ports: Callable[[], int]
) -> None:
    """A master started with what the operator renders for two grants: after real writes (and
    writes refused past a quota), each grant's status says what the master itself reports on
    its admin API (charge, enforced quota) and counts (refused writes)."""
    metrics_port = held_ports()  # the master binds it once the operator has rendered it
    await cluster.create(grant_manifest("team-a", "24MB"))
    await cluster.create(grant_manifest("team-b", "24MB"))
    spec = pool_spec(
        tenancy={"enabled": True},
        master={"metricsPort": metrics_port},
        store={"segmentSize": "32MB", "replicas": 1},
        consumers=[{**consumer(), "name": f"llm-{g}", "grant": g} for g in ("team-a", "team-b")],
    )
    await cluster.create(pool_manifest(spec=spec))
    configmap = await eventually(lambda: cluster.get("v1/configmaps", "pool-tenants"), what="the policy")
    master = await eventually(lambda: cluster.get(DEPLOYMENTS_PATH, "pool-master"), what="the master")
    (container,) = master["spec"]["template"]["spec"]["containers"]
    with tempfile.TemporaryDirectory(prefix="kvpool-grant-usage-") as workdir:
        policy = Path(workdir) / POLICY_FILE
        policy.write_text(configmap["data"][POLICY_FILE])
        flags = tuple(a for a in container["args"] if a.startswith(TENANCY_FLAGS))
        flags += (f"--tenant_quota_connector_uri={policy}",)
        with LocalPool(segment_size="32MB", master_args=flags, metrics_port=metrics_port) as pool:
            assert pool.master is not None
            refused = {"team-a": 0, "team-b": 0}
            for grant, objects, reserved in (("team-a", 5, 0), ("team-b", 2, 24)):
                settings = ConnectorSettings.parse(
                    {
                        "master_server_address": pool.address,
                        "tenant": f"{NAMESPACE}.{grant}",
                        "cache_prefix": "u",
                    }
                )
                client = open_client(settings, global_segment_size=0)
                try:
                    for i in range(objects):
                        assert put_bytes(client, f"u{i}", bytes([i]) * MIB) == 0
                    codes = client.reserve([f"r{i}" for i in range(reserved)], [MIB] * reserved)
                    refused[grant] = sum(1 for c in codes if c == CODE_TENANT_QUOTA_EXCEEDED)
                finally:
                    client.close()
            assert refused["team-b"] > 0
            assert pool.master.tenant_quotas()[f"{NAMESPACE}.team-a"].charged == 5 * MIB
            quotas = pool.master.tenant_quotas

            def usage(grant: str) -> dict[str, Any]:
                return ((cluster.get(GRANTS_PATH, grant) or {}).get("status") or {}).get("usage") or {}

            # Each check reads the admin API afresh (reservations in flight may be released).
            for grant in ("team-a", "team-b"):
                await eventually(
                    lambda grant=grant: usage_matches(
                        usage(grant), quotas()[f"{NAMESPACE}.{grant}"], refused[grant]
                    ),
                    what=f"{grant}'s usage equals the master's own",
                )
            assert usage("team-a")["quotaBytes"] == 16 * MIB and usage("team-a")["used"] == "5Mi (31%)"
            await eventually(
                lambda: (
                    {
                        g["grant"]: g.get("usedBytes")
                        for g in cluster.pool_status("pool")["capacity"]["grants"]
                    }
                    == {g: quotas()[f"{NAMESPACE}.{g}"].charged for g in ("team-a", "team-b")}
                ),
                what="the pool's grants equal the master's own",
            )
        for part in (pool.master, pool.store):
            if part is not None:
                shutil.rmtree(part.log_dir, ignore_errors=True)
