"""Mooncake's tenant quota policy (``--enable_multi_tenants``): the file the master reads, and
the shares it grants when the quotas oversubscribe its memory (pure; docs/tenancy.md).

One source for the local pool (``kvpool.connector.local.tenant_quotas``) and the operator
(its grants): the policy format and the cut are Mooncake 0.3.13's, as measured.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvpool.connector.contract.settings import TENANT_RULE, is_tenant

# Where a policy file's path goes on the master's command line.
POLICY_FILE = "tenant_quotas.yaml"


def policy_yaml(quotas: Mapping[str, int]) -> str:
    """Mooncake's tenant quota policy (schema version 1) granting each tenant its bytes."""
    lines = ["version: 1", "tenants:" if quotas else "tenants: []"]
    for tenant, quota in quotas.items():
        if not is_tenant(tenant):
            raise ValueError(f"{tenant!r} is not a tenant: {TENANT_RULE}")
        if quota < 1:
            raise ValueError(f"tenant {tenant}: a quota is at least 1 byte")
        lines += [f"  - name: {tenant}", f"    quota: {int(quota)}"]
    return "\n".join(lines) + "\n"


def master_args(policy_path: str) -> tuple[str, ...]:
    """The master's flags for strict multi-tenant admission from the policy file at ``policy_path``."""
    return (
        "--enable_multi_tenants=true",
        "--tenant_quota_connector_type=file",
        f"--tenant_quota_connector_uri={policy_path}",
    )


def effective_quotas(requested: Mapping[str, int], capacity: int) -> dict[str, int]:
    """Each tenant's quota as the master admits it: as requested while the requests fit in
    ``capacity``; otherwise ``capacity * requested / sum(requested)``, rounded down, the bytes
    left over going one each to the largest remainders (ties: in order given)."""
    total = sum(requested.values())
    if total <= capacity:
        return dict(requested)
    shares = {tenant: quota * capacity // total for tenant, quota in requested.items()}
    remainders = sorted(requested, key=lambda t: -(requested[t] * capacity % total))
    for tenant in remainders[: capacity - sum(shares.values())]:
        shares[tenant] += 1
    return shares
