"""The NetworkPolicies around a pool: who may reach its masters and stores, its consumers'
transfer ports, and (when its pods are named) etcd. Pure: a spec in, manifests out (the
namespace's own policies are read by ``read_namespace_network``).

What listens where:

* master: RPC (``rpcPort``) and ``metricsPort``, Mooncake's HTTP port. That port serves
  ``/metrics`` and ``/health`` but also an unauthenticated admin API: every key and its
  buffer addresses (``/get_all_keys``, ``/query_key``), segment status, and
  ``POST /api/v1/remove_all``. Only the pool's pods, the scraper pods named in
  ``networkPolicy.metricsFrom`` and the operator's pods (exactly those: their namespace and
  labels, from the admin's ``OperatorPolicy``; it asks ``/health`` and ``/metrics``) reach it.
* store and consumer pods: Mooncake's transfer engine, on ports in
  ``[TRANSFER_PORT_MIN, TRANSFER_PORT_MAX]`` (pinned in consumers with ``MC_MIN_RPC_PORT``
  and ``MC_MAX_RPC_PORT``); whoever reaches them reads and writes the registered memory,
  i.e. the pool's KV.

Masters and stores are the pool's own pods: their policy is the whole truth about them.
Consumers are the tenant's pods, and ingress policies add up: a pod selected by any policy
admits only what some policy selecting it allows, and one selected by none admits all. So
an operator-made policy on consumers may only take away, never add:

* no policy of the namespace selects a consumer (all is open): the consumers' policy admits
  the pool's pods on every port and everyone on every port outside the transfer range
  (``endPort`` ranges). Only the transfer ports close, to everyone but the pool's pods.
* the namespace's own policies select a consumer (a default-deny, a gateway allow): any rule
  the operator added would widen what they admit, so it adds none; the transfer ports are
  as open as those policies make them (an embedded pool, whose consumers reach each other's
  transfer ports, needs the namespace's admin to let the pool's pods in).
* a network plugin without ``endPort`` (the admin's ``OperatorPolicy``) reads each range as
  its first port only, which would cut the consumers' other ports (vLLM's API) off: no
  policy, and the transfer ports stay open as before.

The etcd pods named by ``ha.etcdPodSelector`` are the tenant's too: their policy is added
only where none of the namespace's own selects them. The pool says which applies
(``status.warnings``), and the next pass follows a change of the namespace's policies.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool.connector.contract.layout import Problem
from kvpool.operator import names
from kvpool.operator.names import DEPLOYMENTS, NETWORK_POLICIES, PODS
from kvpool.operator.policy import OperatorPolicy
from kvpool.operator.spec import TRANSFER_PORT_MAX, TRANSFER_PORT_MIN, PoolSpec

TRANSFER_PORT_ENV = (("MC_MIN_RPC_PORT", str(TRANSFER_PORT_MIN)), ("MC_MAX_RPC_PORT", str(TRANSFER_PORT_MAX)))
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"

if TYPE_CHECKING:
    from kvpool.operator.kube import KubeClient


#: Pods labelled with a pool of another namespace (consumers granted to it) carry this label;
#: the pool's own pods never do, so a same-named pool here never takes those pods for its own.
NOT_ANOTHER_NAMESPACES = {"key": names.LABEL_POOL_NAMESPACE, "operator": "DoesNotExist"}


def pool_pods(pool: str) -> dict[str, Any]:
    """A peer: the pool's own pods in its namespace (masters, stores, consumers), never the
    consumers of a same-named pool of another namespace."""
    return {
        "podSelector": {"matchLabels": {names.LABEL_POOL: pool}, "matchExpressions": [NOT_ANOTHER_NAMESPACES]}
    }


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
    also to ``networkPolicy.metricsFrom`` scrapers and to the operator's own pods (its
    namespace and pod labels, never a wider selector), which ask the masters for health, the
    HA leader and capacity."""
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
    if policy is not None and policy.operator_pods_known:
        operator = {
            "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: policy.operator_namespace}},
            "podSelector": {"matchLabels": dict(policy.operator_pod_labels)},
        }
        rules.append({"from": [operator], "ports": metrics_port})
    if spec.tenancy.enabled and spec.tenancy.grant_namespaces:
        rules.append(granted_consumers_rule(pool, namespace, spec))
    pods = {
        "matchLabels": {names.LABEL_POOL: pool},
        "matchExpressions": [
            {"key": names.LABEL_COMPONENT, "operator": "In", "values": [names.MASTER, names.STORE]}
        ],
    }
    return _policy(pool, namespace, names.network_policy_name(pool), pods, rules)


def granted_consumers(pool: str, namespace: str, spec: PoolSpec) -> dict[str, Any]:
    """A peer: consumers in the namespaces the pool takes grants from (pods labelled with the
    pool and its namespace, in exactly those namespaces)."""
    return {
        "namespaceSelector": {
            "matchExpressions": [
                {
                    "key": NAMESPACE_NAME_LABEL,
                    "operator": "In",
                    "values": sorted(spec.tenancy.grant_namespaces),
                }
            ]
        },
        "podSelector": {"matchLabels": {names.LABEL_POOL: pool, names.LABEL_POOL_NAMESPACE: namespace}},
    }


def granted_consumers_rule(pool: str, namespace: str, spec: PoolSpec) -> dict[str, Any]:
    """The granted consumers: the master's RPC port and the transfer ports (the stores'),
    never the master's HTTP port with its admin API."""
    ports = [
        {"protocol": "TCP", "port": spec.master.rpc_port},
        {"protocol": "TCP", "port": TRANSFER_PORT_MIN, "endPort": TRANSFER_PORT_MAX},
    ]
    return {"from": [granted_consumers(pool, namespace, spec)], "ports": ports}


def consumers_pods(pool: str) -> dict[str, Any]:
    """The pool's consumers' pods: the pool's label, no component, not another namespace's."""
    return {
        "matchLabels": {names.LABEL_POOL: pool},
        "matchExpressions": [
            {"key": names.LABEL_COMPONENT, "operator": "DoesNotExist"},
            NOT_ANOTHER_NAMESPACES,
        ],
    }


def consumers_network_policy(pool: str, namespace: str) -> dict[str, Any]:
    """Ingress to the consumers' pods where nothing else selects them: the transfer ports from
    the pool's pods only; every other port (vLLM's API, UDP) to all, as it was without the pool.
    Needs a network plugin that reads ``endPort``."""
    everyone_else = [
        {"protocol": "TCP", "port": 1, "endPort": TRANSFER_PORT_MIN - 1},
        {"protocol": "TCP", "port": TRANSFER_PORT_MAX + 1, "endPort": 65535},
        {"protocol": "UDP", "port": 1, "endPort": 65535},
        {"protocol": "SCTP", "port": 1, "endPort": 65535},
    ]
    rules = [{"from": [pool_pods(pool)]}, {"ports": everyone_else}]
    return _policy(pool, namespace, names.consumers_network_policy_name(pool), consumers_pods(pool), rules)


@dataclass(frozen=True)
class NamespaceNetwork:
    """What the namespace's own NetworkPolicies do to the pods a pool did not create: the names
    of those that select a consumer's pods for ingress (empty: none does, all is open to them),
    and of those that select the etcd pods named by ``ha.etcdPodSelector``."""

    guarding: tuple[str, ...] = ()
    etcd_guarding: tuple[str, ...] = ()


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """Whether a LabelSelector selects ``labels`` (an empty or missing selector selects all). An
    operator it does not know counts as matching: when in doubt, a pod counts as selected, and
    the operator adds nothing that could widen access."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression.get("key"), expression.get("operator"), expression.get("values")
        present = key in labels
        if operator == "In" and not (present and labels[key] in (values or [])):
            return False
        if operator == "NotIn" and present and labels[key] in (values or []):
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


def governs_ingress(policy: Mapping[str, Any]) -> bool:
    """Whether a NetworkPolicy restricts ingress (``policyTypes`` absent: it always does)."""
    types = (policy.get("spec") or {}).get("policyTypes")
    return not types or "Ingress" in types


def guarding_policies(
    policies: Iterable[Mapping[str, Any]], pod_labels: Iterable[Mapping[str, str]], pool_uid: str
) -> tuple[str, ...]:
    """The namespace's ingress policies (not this pool's own) that select any of the pods with
    ``pod_labels`` (the consumers', or the etcd pods')."""
    labels = list(pod_labels)
    found = []
    for policy in policies:
        meta = policy.get("metadata") or {}
        if any(ref.get("uid") == pool_uid for ref in meta.get("ownerReferences") or []):
            continue
        if not governs_ingress(policy):
            continue
        selector = (policy.get("spec") or {}).get("podSelector")
        if any(selects(selector, pod) for pod in labels):
            found.append(str(meta.get("name")))
    return tuple(sorted(found))


def consumer_names(raw_spec: Mapping[str, Any] | None) -> list[str]:
    """The consumer Deployments a raw pool spec names (whatever else is wrong with it)."""
    consumers = (raw_spec or {}).get("consumers")
    if not isinstance(consumers, list):
        return []
    return [c["name"] for c in consumers if isinstance(c, Mapping) and isinstance(c.get("name"), str)]


async def read_namespace_network(kube: KubeClient, pool: Mapping[str, Any]) -> NamespaceNetwork:
    """The namespace's NetworkPolicies that select the pool's consumers (their pods' labels:
    the Deployment's pod template's, plus the pool's label the operator adds)."""
    meta = pool.get("metadata") or {}
    namespace, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
    policies = [
        p
        for p in await kube.list(NETWORK_POLICIES, namespace)
        if not any(ref.get("uid") == uid for ref in (p.get("metadata") or {}).get("ownerReferences") or [])
    ]
    if not policies:
        return NamespaceNetwork()
    pods = []
    for consumer in consumer_names(pool.get("spec")):
        deployment = await kube.get(DEPLOYMENTS, namespace, consumer)
        if deployment is None:
            continue
        template = ((deployment.get("spec") or {}).get("template") or {}).get("metadata") or {}
        pods.append({**(template.get("labels") or {}), names.LABEL_POOL: name})
    etcd_guarding: tuple[str, ...] = ()
    etcd_selector = etcd_pod_selector(pool.get("spec"))
    if etcd_selector:
        selector = ",".join(f"{key}={value}" for key, value in sorted(etcd_selector.items()))
        etcd_pods = await kube.list(PODS, namespace, label_selector=selector)
        etcd_labels = [(p.get("metadata") or {}).get("labels") or {} for p in etcd_pods] or [etcd_selector]
        etcd_guarding = guarding_policies(policies, etcd_labels, uid)
    return NamespaceNetwork(guarding_policies(policies, pods, uid), etcd_guarding)


def etcd_pod_selector(raw_spec: Mapping[str, Any] | None) -> dict[str, str]:
    """The etcd pods' labels a raw pool spec names (empty when it names none, or is not HA)."""
    ha = ((raw_spec or {}).get("master") or {}).get("ha") or {}
    selector = ha.get("etcdPodSelector") if isinstance(ha, Mapping) and ha.get("enabled") else None
    if not isinstance(selector, Mapping):
        return {}
    return {str(k): str(v) for k, v in selector.items() if isinstance(v, str)}


def etcd_protection(
    pool: str, namespace: str, spec: PoolSpec, network: NamespaceNetwork
) -> tuple[dict[str, Any] | None, list[Problem]]:
    """The etcd pods' policy where none of the namespace's own selects them (it then only takes
    away: their client ports to the pool's pods, anything from the members), else None."""
    if not network.etcd_guarding:
        return etcd_network_policy(pool, namespace, spec), []
    named = ", ".join(network.etcd_guarding)
    return None, [
        Problem(
            field="spec.master.ha.etcdPodSelector",
            rule="etcd-namespace-policy",
            message=f"the namespace's NetworkPolicies ({named}) select the etcd pods: the operator adds "
            "no policy to them (it would widen what those admit); they must let the pool's pods "
            f"({names.LABEL_POOL}={pool}), and its granted consumers in other namespaces, in on the "
            "etcd client ports",
        )
    ]


def consumers_protection(
    pool: str, namespace: str, network: NamespaceNetwork, end_port: bool
) -> tuple[dict[str, Any] | None, list[Problem]]:
    """The consumers' policy where one only takes away, or None and what stays open."""
    where = "spec.networkPolicy"
    if network.guarding:
        named = ", ".join(network.guarding)
        return None, [
            Problem(
                field=where,
                rule="consumers-namespace-policy",
                message=f"the namespace's NetworkPolicies ({named}) select the consumers: the operator "
                "adds no policy to them (it would widen what those admit); their transfer ports "
                f"{TRANSFER_PORT_MIN}-{TRANSFER_PORT_MAX} are as open as those policies make them",
            )
        ]
    if not end_port:
        return None, [
            Problem(
                field=where,
                rule="consumers-no-end-port",
                message="the network plugin reads no endPort (operator policy): the consumers get no "
                f"policy, and their transfer ports {TRANSFER_PORT_MIN}-{TRANSFER_PORT_MAX} stay open "
                "to every pod that reaches them",
            )
        ]
    return consumers_network_policy(pool, namespace), []


def etcd_client_ports(endpoints: list[str]) -> list[int]:
    """The distinct client ports of ``host:port`` etcd endpoints."""
    return sorted({int(endpoint.rsplit(":", 1)[1]) for endpoint in endpoints})


def etcd_network_policy(pool: str, namespace: str, spec: PoolSpec) -> dict[str, Any]:
    """Ingress to the etcd pods named by ``ha.etcdPodSelector``: their client ports from the
    pool's pods (masters elect through it; stores and consumers find the leader in it) and
    from its granted consumers in other namespaces (they find the leader there too),
    anything from the etcd members themselves (peer traffic)."""
    selector = {"matchLabels": dict(spec.master.ha.etcd_pod_selector)}
    ports = [{"protocol": "TCP", "port": port} for port in etcd_client_ports(spec.master.ha.etcd_endpoints)]
    clients = [pool_pods(pool)]
    if spec.tenancy.enabled and spec.tenancy.grant_namespaces:
        clients.append(granted_consumers(pool, namespace, spec))
    rules = [{"from": clients, "ports": ports}, {"from": [{"podSelector": selector}]}]
    return _policy(pool, namespace, names.etcd_network_policy_name(pool), selector, rules)
