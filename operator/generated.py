"""The files generated from the operator's code, at their repository paths.

The chart ships them: the CRD (from the pydantic models, ``crd``) and the RBAC rules
(from the rule list, ``rbac``); ``kvpool-operator crd`` and ``rbac`` print the same text.
"""

from __future__ import annotations

from kvpool.operator.crd import render_crd
from kvpool.operator.rbac import RULES, render_rules

CHART = "charts/mooncake-kvpool"
CRD_PATH = f"{CHART}/crds/mooncakekvpools.yaml"
RBAC_RULES_PATH = f"{CHART}/files/rbac-rules.yaml"


def generated_files() -> dict[str, str]:
    """Repository-relative path -> exact content, for every file generated from the operator."""
    return {CRD_PATH: render_crd(), RBAC_RULES_PATH: render_rules(RULES)}
