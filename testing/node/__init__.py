"""A test node: runs what is written to the emulated Kubernetes API as local processes.

No kube-apiserver or kubelet runs here, so this package plays the parts the operator's
output meets on a real cluster: the Deployment and StatefulSet controllers (pods, rollouts,
status), the kubelet (processes, environment, ConfigMap volumes, probes, restarts), cluster
DNS and kube-proxy (Services). Each pod gets its own loopback address. It is test support,
never part of the product: see ``tests/e2e/README.md`` for what it emulates and what only a
real cluster shows.
"""

from testing.node.node import ContainerInfo, Node, NodeError, PodInfo

__all__ = ["ContainerInfo", "Node", "NodeError", "PodInfo"]
