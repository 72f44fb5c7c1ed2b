"""Grants, end to end: two namespaces' grants that oversubscribe a pool get cut shares the
master enforces.

A pool in ``team-a`` with ``spec.tenancy.enabled`` (one master, one 32 MiB store) that takes
grants from ``team-b`` too (``spec.tenancy.grantNamespaces``), a grant of 24 MiB in each
namespace, run on the test node from what the operator writes: the master reads the quota
policy from the ``<pool>-tenants`` ConfigMap mounted into its pod. Each grant's status, in its
own namespace, says the ceiling the master admits after the proportional cut (16 MiB), its
tenant and the master's address; a client on the host writing as each grant's tenant has its
writes past that cut refused by Mooncake itself (``-1700``), never by convention; each grant's
usage in its status is what the master counts; the pool's status names the other namespace's
grant.
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
# (namespace, grant): one in the pool's namespace, one in a tenant's.
GRANTS_OF = ((harness.NAMESPACE, "team-red"), (harness.TENANT_NAMESPACE, "team-blue"))
MIB = 1 << 20


def grant_manifest(namespace: str, name: str, ceiling: str) -> dict[str, Any]:
    return {
        "apiVersion": GRANTS.api_version,
        "kind": GRANTS.kind,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"pool": POOL, "ceiling": ceiling, "poolNamespace": harness.NAMESPACE},
    }


def grant_path(namespace: str, name: str) -> str:
    return path(GRANTS.api_version, GRANTS.kind, name, namespace=namespace)


def grant_status(e2e: E2E, namespace: str, name: str) -> dict[str, Any]:
    return (e2e.kube.get(grant_path(namespace, name)) or {}).get("status") or {}


def test_two_namespaces_oversubscribing_grants_get_cut_shares_the_master_enforces(e2e: E2E) -> None:
    for namespace, name in GRANTS_OF:
        e2e.kube.create(grant_manifest(namespace, name, "24MB"))
    spec = harness.pool_spec(
        "nobody",
        {},
        consumers=[],
        tenancy={"enabled": True, "grantNamespaces": [harness.TENANT_NAMESPACE]},
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
            (namespace, name): wait_for(
                lambda namespace=namespace, name=name: (
                    (s := grant_status(e2e, namespace, name)).get("ceilingBytes") == 16 * MIB and s
                ),
                60,
                f"{namespace}/{name}'s cut ceiling in its status",
            )
            for namespace, name in GRANTS_OF
        }
        assert {s["tenant"] for s in statuses.values()} == {f"{ns}.{name}" for ns, name in GRANTS_OF}
        assert {s["masterServerAddress"] for s in statuses.values()} == {
            f"{MASTER}.{harness.NAMESPACE}.svc:50051"
        }
        assert e2e.pool_status(POOL).get("grantsFromOtherNamespaces") == [
            f"{harness.TENANT_NAMESPACE}/team-blue"
        ]
        (master,) = [p for p in e2e.pods(MASTER) if p.ready]
        refused: dict[tuple[str, str], int] = {}
        for grant, status in statuses.items():
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
                refused[grant] = len(codes) - taken
            finally:
                client.close()

        def usage_seen(grant: tuple[str, str]) -> bool:
            usage = grant_status(e2e, *grant).get("usage") or {}
            return (
                usage.get("state") == "Observed"
                and usage.get("quotaBytes") == 16 * MIB
                and usage.get("rejectedWrites") == refused[grant]
                and usage.get("usedBytes", 0) >= MIB
            )

        for grant in GRANTS_OF:
            wait_for(lambda grant=grant: usage_seen(grant), 60, f"{grant}'s usage as the master counts it")
    finally:
        e2e.delete_pool(POOL)
        for namespace, name in GRANTS_OF:
            e2e.kube.delete(grant_path(namespace, name))
