"""Grants, end to end: two grants that oversubscribe a pool get cut shares the master enforces.

A pool with ``spec.tenancy.enabled`` (one master, one 32 MiB store) and two grants of 24 MiB
each, run on the test node from what the operator writes: the master reads the quota policy
from the ``<pool>-tenants`` ConfigMap mounted into its pod. Each grant's status says the
ceiling the master admits after the proportional cut (16 MiB); a client on the host writing
as each grant's tenant (the tenant the operator renders for it) has its writes past that cut
refused by Mooncake itself (``-1700``), never by convention; each grant's usage in its status
is what the master counts. (Grants live in the pool's namespace: docs/tenancy.md.)
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.pool_client import CODE_TENANT_QUOTA_EXCEEDED, open_client
from kvpool.operator import names
from kvpool.operator.names import GRANTS
from testing.pool_store import put_bytes
from tests.e2e import harness
from tests.e2e.conftest import E2E
from tests.e2e.harness import path, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

POOL = "shared"
MASTER = names.master_name(POOL)
GRANT_NAMES = ("team-red", "team-blue")
MIB = 1 << 20


def grant_manifest(name: str, ceiling: str) -> dict[str, Any]:
    return {
        "apiVersion": GRANTS.api_version,
        "kind": GRANTS.kind,
        "metadata": {"name": name, "namespace": harness.NAMESPACE},
        "spec": {"pool": POOL, "ceiling": ceiling},
    }


def grant_status(e2e: E2E, name: str) -> dict[str, Any]:
    return (e2e.kube.get(path(GRANTS.api_version, GRANTS.kind, name)) or {}).get("status") or {}


def test_oversubscribing_grants_get_cut_shares_the_master_enforces(e2e: E2E) -> None:
    for name in GRANT_NAMES:
        e2e.kube.create(grant_manifest(name, "24MB"))
    spec = harness.pool_spec(
        "nobody",
        {},
        consumers=[],
        tenancy={"enabled": True},
        store={"replicas": 1, "segmentSize": "32MB"},
    )
    e2e.kube.create(harness.pool_manifest(POOL, spec))
    try:
        wait_for(
            lambda: ((e2e.kube.pool(POOL) or {}).get("status") or {}).get("phase") == "Ready",
            120,
            "the pool Ready",
        )
        statuses = {
            name: wait_for(
                lambda name=name: (s := grant_status(e2e, name)).get("ceilingBytes") == 16 * MIB and s,
                60,
                f"{name}'s cut ceiling in its status",
            )
            for name in GRANT_NAMES
        }
        (master,) = [p for p in e2e.pods(MASTER) if p.ready]
        refused: dict[str, int] = {}
        for name, status in statuses.items():
            tenant = status["tenant"]
            settings = ConnectorSettings.parse(
                {"master_server_address": f"{master.ip}:50051", "tenant": tenant, "cache_prefix": "g"}
            )
            client = open_client(settings, global_segment_size=0)
            try:
                assert put_bytes(client, "first", b"x" * MIB) == 0
                # At its quota a tenant's own oldest objects make room: past it, refusals.
                codes = client.reserve([f"r{i}" for i in range(24)], [MIB] * 24)
                taken = sum(1 for c in codes if c == 0)
                assert 0 < taken <= 16, codes
                assert set(codes[taken:]) == {CODE_TENANT_QUOTA_EXCEEDED}, codes
                refused[name] = len(codes) - taken
            finally:
                client.close()

        def usage_seen(name: str) -> bool:
            usage = grant_status(e2e, name).get("usage") or {}
            return (
                usage.get("state") == "Observed"
                and usage.get("quotaBytes") == 16 * MIB
                and usage.get("rejectedWrites") == refused[name]
                and usage.get("usedBytes", 0) >= MIB
            )

        for name in GRANT_NAMES:
            wait_for(lambda name=name: usage_seen(name), 60, f"{name}'s usage as the master counts it")
    finally:
        e2e.delete_pool(POOL)
        for name in GRANT_NAMES:
            e2e.kube.delete(path(GRANTS.api_version, GRANTS.kind, name))
