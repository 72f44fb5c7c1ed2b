"""A small, pure model of Kubernetes NetworkPolicy ingress, to check rendered policies against.

Written from the API's documented semantics, independently of the operator's code:

* a policy governs ingress when ``policyTypes`` names ``Ingress`` (or is absent);
* a pod selected by no ingress-governing policy of its namespace admits everything;
* a pod selected by one or more admits exactly the union of their rules (policies add up);
* a rule admits a connection when a ``from`` peer matches the source (no ``from``: any
  source) and a ``ports`` entry matches the port (no ``ports``: any port);
* a peer with only ``podSelector`` means pods of the policy's own namespace; with only
  ``namespaceSelector`` every pod of the matching namespaces; with both, the matching pods of
  the matching namespaces; ``ipBlock`` peers are not pods and match none here;
* a port entry's protocol defaults to TCP; ``endPort`` makes a range, unless the network
  plugin does not read it: then only ``port`` itself (as the Kubernetes documentation says).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: Mapping[str, str] = field(default_factory=dict)


def _matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], set(expr.get("values") or [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _governs_ingress(policy: Mapping[str, Any]) -> bool:
    types = policy["spec"].get("policyTypes")
    return types is None or "Ingress" in types


@dataclass(frozen=True)
class Cluster:
    """Namespaces (name -> labels) and the NetworkPolicies in force."""

    namespaces: Mapping[str, Mapping[str, str]]
    policies: tuple[Mapping[str, Any], ...]
    end_port: bool = True

    def _peer(self, peer: Mapping[str, Any], policy_namespace: str, source: Pod) -> bool:
        if "ipBlock" in peer:
            return False
        pods, spaces = peer.get("podSelector"), peer.get("namespaceSelector")
        if spaces is None:
            in_namespace = source.namespace == policy_namespace
        else:
            in_namespace = _matches(spaces, self.namespaces[source.namespace])
        return in_namespace and (pods is None or _matches(pods, source.labels))

    def _port(self, entry: Mapping[str, Any], port: int, protocol: str) -> bool:
        if entry.get("protocol", "TCP") != protocol:
            return False
        if "port" not in entry:
            return True
        low = entry["port"]
        high = entry.get("endPort", low) if self.end_port else low
        return low <= port <= high

    def admits(self, source: Pod, target: Pod, port: int, protocol: str = "TCP") -> bool:
        """Whether a connection from ``source`` reaches ``target`` on ``port``."""
        selecting = [
            p
            for p in self.policies
            if p["metadata"]["namespace"] == target.namespace
            and _governs_ingress(p)
            and _matches(p["spec"].get("podSelector", {}), target.labels)
        ]
        if not selecting:
            return True
        for policy in selecting:
            for rule in policy["spec"].get("ingress") or []:
                peers = rule.get("from")
                ports = rule.get("ports")
                peer_ok = not peers or any(
                    self._peer(p, policy["metadata"]["namespace"], source) for p in peers
                )
                port_ok = not ports or any(self._port(e, port, protocol) for e in ports)
                if peer_ok and port_ok:
                    return True
        return False

    def with_policies(self, more: Iterable[Mapping[str, Any]]) -> Cluster:
        return Cluster(self.namespaces, (*self.policies, *more), self.end_port)
