"""Mooncake's tenant quotas for a local master: the policy file it reads, the quotas it reports.

With ``--enable_multi_tenants`` the master admits a write only for a tenant its policy
names, and only within that tenant's effective quota: the requested quota, or, when
the requested quotas add up to more than the memory mounted, a share of that memory
in proportion to them. The master reports each tenant's quota and charge on its
metrics port (``/api/v1/tenant_quotas``, which also takes unauthenticated changes:
docs/tenancy.md).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.connector.contract.tenant_policy import master_args, policy_yaml

__all__ = ["TenantQuota", "master_args", "policy_yaml", "read_quotas", "write_policy"]


@dataclass(frozen=True)
class TenantQuota:
    """One tenant as the master reports it (bytes)."""

    tenant: str
    requested: int
    effective: int  # what the master admits: the requested quota, cut when oversubscribed
    charged: int  # memory of its objects and of its reservations in flight
    over_quota: bool
    admission_closed: bool

    @classmethod
    def from_master(cls, row: Mapping[str, Any]) -> TenantQuota:
        return cls(
            tenant=str(row["tenant_id"]),
            requested=int(row["requested_quota_bytes"]),
            effective=int(row["effective_quota_bytes"]),
            charged=int(row["charged_bytes"]),
            over_quota=bool(row["over_quota"]),
            admission_closed=bool(row["admission_closed"]),
        )


def write_policy(path: Path, quotas: Mapping[str, int]) -> tuple[str, ...]:
    """Write the policy file and return the master's flags that read it."""
    path.write_text(policy_yaml(quotas))
    return master_args(str(path))


def read_quotas(metrics_host_port: str, timeout: float = 5.0) -> dict[str, TenantQuota]:
    """Every tenant's quota and charge, from the master's admin API on its metrics port."""
    url = f"http://{metrics_host_port}/api/v1/tenant_quotas"
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body = json.loads(response.read())
    if not body.get("success"):
        raise RuntimeError(f"{url}: {body}")
    return {row["tenant_id"]: TenantQuota.from_master(row) for row in body["data"]}
