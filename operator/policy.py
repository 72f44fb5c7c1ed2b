"""What the cluster's admin allows pools, and who the operator's own pods are: the operator's
settings that shape every pool it runs.

A pool is a Deployment its author writes through the operator, so the admin's limits on
Deployments must hold for it too: where its image comes from (registries, with path
boundaries), its priority class, its tolerations and node selectors (never the control
plane), its replica counts, and whether it may run without its NetworkPolicy (whose
absence opens the master's unauthenticated admin API to the cluster).

Set by ``kvpool-operator run`` flags (the chart's ``operator.policy`` values). The CRD
refuses the control plane's keys and the ``system-`` priority classes itself (CEL rules in
``spec.py``), whatever the policy says; the rest is checked here (``policy_problems``), so a
pool beyond the policy gets ``ConfigValid=False`` naming the field and the rule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvpool.connector.contract.layout import Problem
from kvpool.operator.spec import CONTROL_PLANE_KEYS, PoolSpec, Toleration

# Kubernetes reserves this prefix for its own priority classes (system-cluster-critical,
# system-node-critical): pods there preempt anything, and evict last.
SYSTEM_PRIORITY_PREFIX = "system-"
DEFAULT_REGISTRY = "docker.io"
# host[:port] and a path of lowercase components: what an allowed-registry entry may be.
_REGISTRY_ENTRY = re.compile(
    r"(?P<host>[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?(:[0-9]{1,5})?)(?P<path>(/[a-z0-9]+([._-][a-z0-9]+)*)*)"
)


@dataclass(frozen=True)
class ImageName:
    """Where an image comes from: its registry (``host[:port]``) and repository path."""

    registry: str
    path: str


def image_name(image: str) -> ImageName | None:
    """An image reference's registry and path, as container runtimes read it (no registry
    part: Docker Hub, ``library/`` for one component); None if it is not a reference."""
    name = image.split("@", 1)[0]
    first, slash, rest = name.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        registry, path = first.lower(), rest
    else:
        registry, path = DEFAULT_REGISTRY, name if slash else f"library/{name}"
    head, _, last = path.rpartition("/")
    path = f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]
    components = path.split("/")
    if not registry or any(not c or c in (".", "..") or c != c.strip() for c in components):
        return None
    return ImageName(registry, path)


def registry_entry(entry: str) -> ImageName:
    """An allowed-registry entry (``registry.internal``, ``registry.internal:5000/team``);
    ``ValueError`` when it is not one."""
    match = _REGISTRY_ENTRY.fullmatch(entry)
    if match is None:
        raise ValueError(f"{entry!r} is not a registry host[:port] with an optional /path")
    return ImageName(match["host"].lower(), match["path"].lstrip("/"))


def registry_allows(entry: str, image: str) -> bool:
    """Whether ``image`` comes from ``entry``: the same registry host and port, and the same
    path or one below it (``registry.internal`` never admits ``registry.internal.evil.com``,
    ``registry.internal:5000`` or, for ``.../team``, ``.../team-b``)."""
    allowed, name = registry_entry(entry), image_name(image)
    if name is None or name.registry != allowed.registry:
        return False
    return not allowed.path or name.path == allowed.path or name.path.startswith(allowed.path + "/")


@dataclass(frozen=True)
class OperatorPolicy:
    """Limits on what a pool may ask for, and the operator's own pods (for the NetworkPolicy)."""

    # A pool's image must come from one of these (``host[:port][/path]``; empty: any image).
    allowed_registries: tuple[str, ...] = ()
    max_master_replicas: int | None = None
    max_store_replicas: int | None = None
    # Priority classes pools may use (empty: any but the system- ones).
    allowed_priority_classes: tuple[str, ...] = ()
    # Taint keys pools may tolerate (empty: any but the protected ones).
    allowed_toleration_keys: tuple[str, ...] = ()
    # Taint keys pools may never tolerate and node labels they may never select, beyond the
    # control plane's (always refused).
    protected_node_keys: tuple[str, ...] = ()
    # Whether a pool may set networkPolicy.enabled: false.
    allow_network_policy_opt_out: bool = False
    # Whether the cluster's network plugin reads a NetworkPolicy port's endPort.
    network_policy_end_port: bool = True
    # Whether a pool may name an external master (``spec.external``): the operator then asks
    # an address the pool's author wrote for /health and /metrics.
    allow_external_pools: bool = True
    # The operator's pods (namespace and labels): let in to the masters' HTTP (metrics) port.
    operator_namespace: str | None = None
    operator_pod_labels: tuple[tuple[str, str], ...] = ()
    # The namespaces the operator watches (``--namespace``; empty: all): a pool may take grants
    # only from these, the only ones the operator can read.
    watched_namespaces: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for entry in self.allowed_registries:
            registry_entry(entry)

    @property
    def operator_pods_known(self) -> bool:
        return bool(self.operator_namespace and self.operator_pod_labels)

    @property
    def protected_keys(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(CONTROL_PLANE_KEYS + self.protected_node_keys))


def _image(spec: PoolSpec, policy: OperatorPolicy) -> list[Problem]:
    entries = policy.allowed_registries
    if spec.image is None or not entries or any(registry_allows(entry, spec.image) for entry in entries):
        return []
    allowed = ", ".join(repr(e) for e in policy.allowed_registries)
    return [
        Problem(
            field="spec.image",
            rule="image-registry",
            message=f"image {spec.image!r} comes from none of the allowed registries ({allowed})",
        )
    ]


def _priority_class(where: str, name: str | None, policy: OperatorPolicy) -> list[Problem]:
    if name is None:
        return []
    if policy.allowed_priority_classes:
        if name in policy.allowed_priority_classes:
            return []
        allowed = ", ".join(repr(p) for p in policy.allowed_priority_classes)
        message = f"priority class {name!r} is not one of the allowed ({allowed})"
    elif name.startswith(SYSTEM_PRIORITY_PREFIX):
        message = f"priority class {name!r} is reserved for the cluster's own components"
    else:
        return []
    return [Problem(field=f"{where}.priorityClassName", rule="priority-class", message=message)]


def _toleration(where: str, toleration: Toleration, policy: OperatorPolicy) -> list[Problem]:
    protected = policy.protected_keys
    key = toleration.key or ""
    if not key:
        if toleration.operator == "Exists" and protected:
            return [
                Problem(
                    field=f"{where}.key",
                    rule="toleration-protected",
                    message="a toleration without a key tolerates every taint, the control plane's too",
                )
            ]
        return []
    if key in protected:
        return [
            Problem(
                field=f"{where}.key",
                rule="toleration-protected",
                message=f"taint {key!r} marks nodes pools may not run on",
            )
        ]
    if policy.allowed_toleration_keys and key not in policy.allowed_toleration_keys:
        allowed = ", ".join(repr(k) for k in policy.allowed_toleration_keys)
        return [
            Problem(
                field=f"{where}.key",
                rule="toleration-allowlist",
                message=f"taint {key!r} is not one of those pools may tolerate ({allowed})",
            )
        ]
    return []


def _placement(spec: PoolSpec, policy: OperatorPolicy) -> list[Problem]:
    problems = []
    for component, placed in (("master", spec.master), ("store", spec.store)):
        where = f"spec.{component}"
        problems += _priority_class(where, placed.priority_class_name, policy)
        for index, toleration in enumerate(placed.tolerations):
            problems += _toleration(f"{where}.tolerations[{index}]", toleration, policy)
        for key in placed.node_selector:
            if key in policy.protected_keys:
                problems.append(
                    Problem(
                        field=f"{where}.nodeSelector",
                        rule="node-selector-protected",
                        message=f"node label {key!r} selects nodes pools may not run on",
                    )
                )
    return problems


def _replicas(spec: PoolSpec, policy: OperatorPolicy) -> list[Problem]:
    problems = []
    for field, replicas, cap in (
        ("spec.master.replicas", spec.master.replicas, policy.max_master_replicas),
        ("spec.store.replicas", spec.store.replicas, policy.max_store_replicas),
    ):
        if cap is not None and replicas > cap:
            problems.append(
                Problem(
                    field=field,
                    rule="replica-cap",
                    message=f"{replicas} replicas are above the operator's cap of {cap}",
                )
            )
    return problems


def _network_policy(spec: PoolSpec, policy: OperatorPolicy) -> list[Problem]:
    if spec.network_policy.enabled or policy.allow_network_policy_opt_out:
        return []
    return [
        Problem(
            field="spec.networkPolicy.enabled",
            rule="network-policy-required",
            message="the operator's policy keeps every pool's NetworkPolicy on: without it the "
            "master's unauthenticated admin API is open to every pod of the cluster",
        )
    ]


def _external(spec: PoolSpec, policy: OperatorPolicy) -> list[Problem]:
    if spec.external is None or policy.allow_external_pools:
        return []
    return [
        Problem(
            field="spec.external",
            rule="external-pools-forbidden",
            message="the operator's policy allows no external pools: run the master in the pool "
            "(remove spec.external)",
        )
    ]


def policy_problems(spec: PoolSpec, policy: OperatorPolicy) -> list[Problem]:
    """Everything in ``spec`` beyond what the admin's policy allows."""
    return (
        _image(spec, policy)
        + _external(spec, policy)
        + _replicas(spec, policy)
        + _placement(spec, policy)
        + _network_policy(spec, policy)
    )
