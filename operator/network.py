"""The NetworkPolicies around a pool: who may reach its masters and stores, its consumers'
transfer ports, and (when its pods are named) etcd. Pure: a spec in, manifests out.

What listens where:

* master: RPC (``rpcPort``) and ``metricsPort``, Mooncake's HTTP port. That port serves
  ``/metrics`` and ``/health`` but also an unauthenticated admin API: every key and its
  buffer addresses (``/get_all_keys``, ``/query_key``), segment status, and
  ``POST /api/v1/remove_all``. Only the pool's pods, the scraper pods named in
  ``networkPolicy.metricsFrom`` and (HA) the operator's pods reach it.
* store and consumer pods: Mooncake's transfer engine, on ports in
  ``[TRANSFER_PORT_MIN, TRANSFER_PORT_MAX]`` (pinned in consumers with ``MC_MIN_RPC_PORT``
  and ``MC_MAX_RPC_PORT``); whoever reaches them reads and writes the registered memory,
  i.e. the pool's KV. Only the pool's pods reach them; a consumer's other ports (vLLM's
  API) stay open.
"""

from __future__ import annotations

from typing import Any

from kvpool.operator import names
from kvpool.operator.policy import OperatorPolicy
from kvpool.operator.spec import PoolSpec

# Mooncake's transfer engine listens on ports in this range (its own default, pinned).
TRANSFER_PORT_MIN = 15000
TRANSFER_PORT_MAX = 17000
TRANSFER_PORT_ENV = (("MC_MIN_RPC_PORT", str(TRANSFER_PORT_MIN)), ("MC_MAX_RPC_PORT", str(TRANSFER_PORT_MAX)))
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def pool_pods(pool: str) -> dict[str, Any]:
    """A peer: the pool's own pods in its namespace (masters, stores, consumers)."""
    return {"podSelector": {"matchLabels": {names.LABEL_POOL: pool}}}


def _policy(pool: str, namespace: str, name: str, pods: dict[str, Any], rules: list[dict[str, Any]]) -> dict:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": names.child_metadata(pool, namespace, name, "network-policy"),
        "spec": {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": rules},
    }


def network_policy(
    pool: str, namespace: str, spec: PoolSpec, policy: OperatorPolicy | None = None
) -> dict[str, Any]:
    """Ingress to master and store pods: the pool's own pods on any port; the metrics port
    also to ``networkPolicy.metricsFrom`` scrapers and, for HA leader checks, the operator."""
    rules: list[dict[str, Any]] = [{"from": [pool_pods(pool)]}]
    metrics_port = [{"protocol": "TCP", "port": spec.master.metrics_port}]
    if spec.network_policy.metrics_from:
        rules.append(
            {
                "from": [
                    {
                        "namespaceSelector": {"matchLabels": dict(scraper.namespace_selector)},
                        "podSelector": {"matchLabels": dict(scraper.pod_selector)},
                    }
                    for scraper in spec.network_policy.metrics_from
                ],
                "ports": metrics_port,
            }
        )
    if spec.master.ha.enabled and policy is not None and policy.operator_pods_known:
        operator = {
            "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: policy.operator_namespace}},
            "podSelector": {"matchLabels": dict(policy.operator_pod_labels)},
        }
        rules.append({"from": [operator], "ports": metrics_port})
    pods = {
        "matchLabels": {names.LABEL_POOL: pool},
        "matchExpressions": [
            {"key": names.LABEL_COMPONENT, "operator": "In", "values": [names.MASTER, names.STORE]}
        ],
    }
    return _policy(pool, namespace, names.network_policy_name(pool), pods, rules)


def consumers_network_policy(pool: str, namespace: str) -> dict[str, Any]:
    """Ingress to the consumers' pods: their transfer ports from the pool's pods only.

    Every other port (vLLM's API, UDP) stays open to all, as it was without the pool.
    """
    everyone_else = [
        {"protocol": "TCP", "port": 1, "endPort": TRANSFER_PORT_MIN - 1},
        {"protocol": "TCP", "port": TRANSFER_PORT_MAX + 1, "endPort": 65535},
        {"protocol": "UDP", "port": 1, "endPort": 65535},
    ]
    pods = {
        "matchLabels": {names.LABEL_POOL: pool},
        "matchExpressions": [{"key": names.LABEL_COMPONENT, "operator": "DoesNotExist"}],
    }
    rules = [{"from": [pool_pods(pool)]}, {"ports": everyone_else}]
    return _policy(pool, namespace, names.consumers_network_policy_name(pool), pods, rules)


def etcd_client_ports(endpoints: list[str]) -> list[int]:
    """The distinct client ports of ``host:port`` etcd endpoints."""
    return sorted({int(endpoint.rsplit(":", 1)[1]) for endpoint in endpoints})


def etcd_network_policy(pool: str, namespace: str, spec: PoolSpec) -> dict[str, Any]:
    """Ingress to the etcd pods named by ``ha.etcdPodSelector``: their client ports from the
    pool's pods (masters elect through it; stores and consumers find the leader in it),
    anything from the etcd members themselves (peer traffic)."""
    selector = {"matchLabels": dict(spec.master.ha.etcd_pod_selector)}
    ports = [{"protocol": "TCP", "port": port} for port in etcd_client_ports(spec.master.ha.etcd_endpoints)]
    rules = [{"from": [pool_pods(pool)], "ports": ports}, {"from": [{"podSelector": selector}]}]
    return _policy(pool, namespace, names.etcd_network_policy_name(pool), selector, rules)
