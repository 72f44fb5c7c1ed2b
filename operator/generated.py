"""The files generated from the operator's code, at their repository paths.

The chart ships them: the CRDs of pools and grants (from the pydantic models, ``crd``) and the RBAC rules
(from the rule lists, ``rbac``: the operator's own, and the tenants' aggregated ``edit`` and
``view`` rules); ``kvpool-operator crd`` and ``rbac`` print the same text. The rule the operator
has cluster-wide in namespaced mode, to remove pools' finalizers (``FINALIZER_RULES``), is
written by ``scripts/generate.py`` alone.
"""

from __future__ import annotations

from kvpool.operator.crd import build_grant_crd, render_crd
from kvpool.operator.rbac import FINALIZER_RULES, RULES, TENANT_RULES, render_rules

CHART = "charts/mooncake-kvpool"
CRD_PATH = f"{CHART}/crds/mooncakekvpools.yaml"
GRANT_CRD_PATH = f"{CHART}/crds/mooncakekvpoolgrants.yaml"
RBAC_RULES_PATH = f"{CHART}/files/rbac-rules.yaml"
FINALIZER_RULES_PATH = f"{CHART}/files/rbac-finalizer-rules.yaml"
TENANT_RULES_PATHS = {role: f"{CHART}/files/rbac-tenant-{role}.yaml" for role in TENANT_RULES}


def generated_files() -> dict[str, str]:
    """Repository-relative path -> exact content, for every file generated from the operator."""
    files = {
        CRD_PATH: render_crd(),
        GRANT_CRD_PATH: render_crd(build_grant_crd(), "kvpool-operator crd --grant"),
        RBAC_RULES_PATH: render_rules(RULES),
        FINALIZER_RULES_PATH: render_rules(FINALIZER_RULES, "scripts/generate.py"),
    }
    for role, rules in TENANT_RULES.items():
        files[TENANT_RULES_PATHS[role]] = render_rules(rules, f"kvpool-operator rbac --tenant {role}")
    return files
