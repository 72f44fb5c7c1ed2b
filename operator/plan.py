"""The desired state of one pool, computed from its spec and the operator's policy (no API calls)."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.connector.contract.layout import Problem
from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.operator import names
from kvpool.operator.components import (
    drains_on_scale_down,
    master_address,
    master_deployment,
    master_service,
    pod_disruption_budget,
    store_deployment,
)
from kvpool.operator.connector_settings import connector_configmap
from kvpool.operator.consumers import Injection, plan_injection
from kvpool.operator.grants import (
    Grant,
    Tenancy,
    consumer_grant_problems,
    grant_ref,
    plan_tenancy,
    tenants_configmap,
)
from kvpool.operator.merge_patch import digest
from kvpool.operator.names import (
    CONFIGMAPS,
    DEPLOYMENTS,
    GRANTS,
    NETWORK_POLICIES,
    POD_DISRUPTION_BUDGETS,
    SERVICES,
    ApiResource,
)
from kvpool.operator.network import (
    NamespaceNetwork,
    consumers_protection,
    etcd_protection,
    network_policy,
)
from kvpool.operator.policy import OperatorPolicy
from kvpool.operator.spec import ConsumerSpec, PoolSpec
from kvpool.operator.validation import validate, warnings


@dataclass(frozen=True)
class GrantChild:
    """An object in a grant's namespace, owned by the grant."""

    grant: Grant
    obj: dict[str, Any]
    # Its consumers another grant of its namespace lists first (by name): Deployment -> that grant.
    listed_elsewhere: dict[str, str] = field(default_factory=dict)

    def owned(self) -> dict[str, Any]:
        """The object with the grant as its owner. ``blockOwnerDeletion`` stays off: setting it
        needs ``update`` on the grants' finalizers, which the operator is not given, and
        nothing needs a grant's deletion to wait for its ConfigMap."""
        obj = copy.deepcopy(self.obj)
        obj["metadata"]["ownerReferences"] = [
            {
                "apiVersion": GRANTS.api_version,
                "kind": GRANTS.kind,
                "name": self.grant.name,
                "uid": self.grant.uid,
                "controller": True,
                "blockOwnerDeletion": False,
            }
        ]
        return obj


@dataclass(frozen=True)
class Plan:
    """Everything a pool should have; ``problems`` non-empty means: change nothing."""

    pool: str
    namespace: str
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    master_address: str = ""
    embedded: bool = False
    ha: bool = False
    metrics_port: int = 0
    # An external pool: its master is not the pool's (``spec.external``), nor its stores.
    external: bool = False
    # The master HTTP ports (host:port) the operator asks of an external pool.
    metrics_endpoints: tuple[str, ...] = ()
    # Store pods that should mount memory at the master (None: embedded or external).
    store_replicas: int | None = None
    # How long a scale-down of the stores waits for their drain (0: none; HA and embedded:
    # none, see ``store_drain``).
    drain_seconds: int = 0
    # Whether the operator asks the master for health and capacity: an external pool that
    # names its masters' HTTP ports, or a pool whose NetworkPolicy lets the operator in.
    observed: bool = False
    children: list[dict[str, Any]] = field(default_factory=list)
    absent: list[tuple[ApiResource, str]] = field(default_factory=list)
    consumers: list[Injection] = field(default_factory=list)
    # The grants' tenants and quotas (None: tenancy is off).
    tenancy: Tenancy | None = None
    # What the pool writes in its grants' namespaces (their consumers' connector ConfigMaps),
    # each owned by its grant (an owner reference never crosses namespaces).
    grant_children: list[GrantChild] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.problems


def children_names(pool: str) -> list[tuple[ApiResource, str]]:
    """Every child a pool may own, whatever its spec (for teardown)."""
    return [
        (DEPLOYMENTS, names.store_name(pool)),
        (DEPLOYMENTS, names.master_name(pool)),
        (POD_DISRUPTION_BUDGETS, names.store_name(pool)),
        (POD_DISRUPTION_BUDGETS, names.master_name(pool)),
        (SERVICES, names.master_name(pool)),
        (NETWORK_POLICIES, names.network_policy_name(pool)),
        (NETWORK_POLICIES, names.consumers_network_policy_name(pool)),
        (NETWORK_POLICIES, names.etcd_network_policy_name(pool)),
        (CONFIGMAPS, names.connector_configmap_name(pool)),
        (CONFIGMAPS, names.tenants_configmap_name(pool)),
    ]


def build_plan(
    pool: str,
    namespace: str,
    raw_spec: Mapping[str, Any] | None,
    policy: OperatorPolicy | None = None,
    network: NamespaceNetwork | None = None,
    grants: Sequence[Grant] = (),
) -> Plan:
    """Validate the spec and build every desired object from it (``network``: what the
    namespace's own NetworkPolicies do to the consumers; default: none selects them;
    ``grants``: those of the pool's namespace and of its ``tenancy.grantNamespaces``)."""
    policy = policy or OperatorPolicy()
    spec, settings, problems = validate(pool, namespace, raw_spec, policy)
    if spec is not None:
        problems = problems + consumer_grant_problems(pool, namespace, spec, grants)
    if problems or spec is None or settings is None:
        return Plan(pool=pool, namespace=namespace, problems=problems)
    address = master_address(pool, namespace, spec)
    configmap = connector_configmap(pool, namespace, settings)
    tenancy = (
        plan_tenancy(pool, namespace, grants, declared_capacity(spec), spec.tenancy.grant_namespaces)
        if spec.tenancy.enabled
        else None
    )
    tenants = tenancy.tenants if tenancy else {}
    injections = [
        plan_injection(
            pool, c, settings, configmap, tenants.get(c.grant or "", ""), grant=own_grant(c, tenancy)
        )
        for c in spec.consumers
    ]
    grant_children: list[GrantChild] = []
    if tenancy is not None:
        grant_children, granted = grant_consumers(pool, namespace, settings, tenancy, grants)
        injections += granted
    if spec.external is not None:
        return external_plan(
            pool,
            namespace,
            spec,
            configmap,
            injections,
        )
    master = master_deployment(pool, namespace, spec)
    children = [
        configmap,
        master,
        master_service(pool, namespace, spec),
        pod_disruption_budget(pool, namespace, names.MASTER, only_pod=not spec.master.ha.enabled),
    ]
    absent: list[tuple[ApiResource, str]] = []
    if tenancy is not None:
        children.append(tenants_configmap(pool, namespace, tenancy))
        if spec.tenancy.grant_changes == "RestartMaster":
            roll_on_policy_change(master, tenancy)
    else:
        absent.append((CONFIGMAPS, names.tenants_configmap_name(pool)))
    embedded = spec.store.mode == "embedded"
    if embedded:
        absent += [(DEPLOYMENTS, names.store_name(pool)), (POD_DISRUPTION_BUDGETS, names.store_name(pool))]
    else:
        children.append(store_deployment(pool, namespace, spec, address, settings.metadata_server))
        children.append(pod_disruption_budget(pool, namespace, names.STORE))
    enabled = spec.network_policy.enabled
    guard_etcd = enabled and spec.master.ha.enabled and bool(spec.master.ha.etcd_pod_selector)
    etcd_policy, etcd_warnings = (
        etcd_protection(pool, namespace, spec, network or NamespaceNetwork()) if guard_etcd else (None, [])
    )
    consumers_policy, network_warnings = (
        consumers_protection(pool, namespace, network or NamespaceNetwork(), policy.network_policy_end_port)
        if enabled
        else (None, [])
    )
    policies = [
        (names.network_policy_name(pool), enabled and network_policy(pool, namespace, spec, policy)),
        (names.consumers_network_policy_name(pool), consumers_policy),
        (names.etcd_network_policy_name(pool), etcd_policy),
    ]
    for name, obj in policies:
        if obj:
            children.append(obj)
        else:
            absent.append((NETWORK_POLICIES, name))
    return Plan(
        pool=pool,
        namespace=namespace,
        warnings=warnings(spec) + network_warnings + etcd_warnings,
        master_address=address,
        embedded=embedded,
        ha=spec.master.ha.enabled,
        metrics_port=spec.master.metrics_port,
        store_replicas=None if embedded else spec.store.replicas,
        drain_seconds=spec.store.drain_timeout_seconds if drains_on_scale_down(spec) else 0,
        observed=not enabled or policy.operator_pods_known,
        children=children,
        absent=absent,
        consumers=injections,
        tenancy=tenancy,
        grant_children=grant_children,
    )


def own_grant(consumer: ConsumerSpec, tenancy: Tenancy | None) -> str:
    """The grant a consumer of the pool's own namespace uses (empty: tenancy is off)."""
    return (consumer.grant or "") if tenancy is not None else ""


def grant_consumers(
    pool: str, namespace: str, settings: ConnectorSettings, tenancy: Tenancy, grants: Sequence[Grant]
) -> tuple[list[GrantChild], list[Injection]]:
    """The consumers of the other namespaces' grants the pool serves, each with its grant's
    tenant; each such grant gets a connector ConfigMap in its namespace, owned by it (its
    consumers mount it; one configured by hand may too). A Deployment two grants of one
    namespace list is the first grant's (by name); the other grant's child says so."""
    children: list[GrantChild] = []
    injections: list[Injection] = []
    taken: dict[tuple[str, str], str] = {}
    for grant in sorted(grants, key=lambda g: (g.namespace, g.name)):
        ref = grant_ref(grant, namespace)
        if grant.spec is None or grant.namespace == namespace or ref not in tenancy.tenants:
            continue
        if not grant.uid:  # what it writes for the grant is owned by it: never by nobody
            continue
        configmap = connector_configmap(pool, grant.namespace, settings)
        configmap["metadata"]["name"] = names.grant_connector_configmap_name(pool, grant.name)
        listed_elsewhere: dict[str, str] = {}
        children.append(GrantChild(grant, configmap, listed_elsewhere))
        for consumer in grant.spec.consumers:
            first = taken.setdefault((grant.namespace, consumer.name), grant.name)
            if first != grant.name:
                listed_elsewhere[consumer.name] = first
                continue
            injections.append(
                plan_injection(
                    pool, consumer, settings, configmap, tenancy.tenants[ref], grant.namespace, namespace, ref
                )
            )
    return children, injections


def roll_on_policy_change(master: dict[str, Any], tenancy: Tenancy) -> None:
    """Stamp the quota policy's digest on the master's pod template: the master reads the
    policy only when it starts, so a grant change rolls it (``grantChanges: RestartMaster``)."""
    template = master["spec"]["template"].setdefault("metadata", {})
    template.setdefault("annotations", {})[names.ANNOTATION_TENANT_POLICY] = digest(tenancy.policy())


def declared_capacity(spec: PoolSpec) -> int | None:
    """The memory the store pods mount (None: embedded, the vLLM ranks mount it)."""
    return spec.store.segment_size * spec.store.replicas if spec.store.mode == "standalone" else None


def external_plan(
    pool: str, namespace: str, spec: PoolSpec, configmap: dict[str, Any], consumers: list[Injection]
) -> Plan:
    """An external pool: the connector's ConfigMap and the consumers, nothing that runs. The
    master, its stores and its network are someone else's: no NetworkPolicy of the pool's (its
    consumers' transfer ports are reached by stores that are not the pool's pods)."""
    assert spec.external is not None
    absent = [
        (resource, name)
        for resource, name in children_names(pool)
        if not (resource == CONFIGMAPS and name == names.connector_configmap_name(pool))
    ]
    return Plan(
        pool=pool,
        namespace=namespace,
        warnings=[
            *warnings(spec),
            Problem(
                field="spec.external",
                rule="external-network",
                message="the operator writes no NetworkPolicy for an external pool: its master's "
                "admin port and its stores' memory are as reachable as their own namespace's "
                "policies make them, and the consumers' transfer ports as open as this namespace's",
            ),
        ],
        master_address=spec.external.master_server_address,
        embedded=spec.store.mode == "embedded",
        external=True,
        metrics_endpoints=tuple(spec.external.metrics_endpoints),
        observed=bool(spec.external.metrics_endpoints),
        children=[configmap],
        absent=absent,
        consumers=consumers,
    )
