"""The NetworkPolicy: master and store pods take traffic only from the pool's own pods."""

from __future__ import annotations

from typing import Any

from kvpool.operator import names
from kvpool.operator.models import PoolSpec


def network_policy(pool: str, namespace: str, spec: PoolSpec) -> dict[str, Any]:
    """Ingress to master/store pods: from pods labelled with the pool (its own, consumers).

    Consumers carry the pool label on their pod template (the operator puts it there).
    Data transfers use dynamic ports, so pool pods may use any port; namespaces in
    ``networkPolicy.metricsFrom`` may also reach the master's metrics port.
    """
    rules: list[dict[str, Any]] = [{"from": [{"podSelector": {"matchLabels": {names.LABEL_POOL: pool}}}]}]
    if spec.network_policy.metrics_from:
        rules.append(
            {
                "from": [
                    {"namespaceSelector": {"matchLabels": dict(selector)}}
                    for selector in spec.network_policy.metrics_from
                ],
                "ports": [{"protocol": "TCP", "port": spec.master.metrics_port}],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": names.network_policy_name(pool),
            "namespace": namespace,
            "labels": names.labels(pool, "network-policy"),
        },
        "spec": {
            "podSelector": {
                "matchLabels": {names.LABEL_POOL: pool},
                "matchExpressions": [
                    {
                        "key": names.LABEL_COMPONENT,
                        "operator": "In",
                        "values": [names.MASTER, names.STORE],
                    }
                ],
            },
            "policyTypes": ["Ingress"],
            "ingress": rules,
        },
    }
