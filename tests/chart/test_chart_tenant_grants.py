"""Who may make MooncakeKVPoolGrants: the cluster admin by default; namespace admins (the
aggregated ``admin`` role, never ``edit``) only when ``rbac.namespaceAdminsGrant`` says so."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.operator.names import GRANTS
from tests.chart.helm import Helm, of_kind

AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"


def tenant_roles(helm: Helm, sets: list[str]) -> dict[str, dict[str, Any]]:
    roles = of_kind(helm.template(sets=sets), "ClusterRole")
    return {
        r["metadata"]["name"].rsplit("-", 1)[1]: r
        for r in roles
        if r["metadata"]["labels"].get("app.kubernetes.io/component") == "tenant-rbac"
    }


@pytest.mark.parametrize(("allowed", "sets"), [(False, []), (True, ["rbac.namespaceAdminsGrant=true"])])
def test_namespace_admins_make_grants_only_when_allowed(helm: Helm, allowed: bool, sets: list[str]) -> None:
    roles = tenant_roles(helm, sets)
    assert set(roles) == ({"edit", "view", "grant"} if allowed else {"edit", "view"})
    for name in ("edit", "view"):
        for rule in roles[name]["rules"]:
            if GRANTS.plural in rule["resources"]:
                assert set(rule["verbs"]) == {"get", "list", "watch"}
    if allowed:
        grant = roles["grant"]
        aggregated = {k[len(AGGREGATE) :] for k in grant["metadata"]["labels"] if k.startswith(AGGREGATE)}
        assert aggregated == {"admin"}
        assert [r["resources"] for r in grant["rules"]] == [[GRANTS.plural]]
