"""Every reason a pool spec cannot be served, as the contract's ``Problem`` records.

Consumer layouts go through the connector's own ``check``; connector settings through
its own ``ConnectorSettings``. The operator adds only the rules about what it runs.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from kvpool.connector.contract.declared_layout import incomplete
from kvpool.connector.contract.errors import error_message, field_path
from kvpool.connector.contract.layout import Problem, check
from kvpool.connector.contract.settings import ConnectorSettings, SettingsError
from kvpool.operator import names
from kvpool.operator.components import STORE_MEMORY_OVERHEAD, store_memory_limit
from kvpool.operator.connector_settings import pool_connector_settings, spec_field_of
from kvpool.operator.disk_tier import check_disk_tier
from kvpool.operator.leader import unmapped
from kvpool.operator.policy import OperatorPolicy, policy_problems
from kvpool.operator.spec import (
    TRANSFER_PORT_MAX,
    TRANSFER_PORT_MIN,
    ComputeResources,
    GrantConsumerSpec,
    PoolSpec,
    format_bytes,
    parse_quantity,
)


def location(loc: tuple[int | str, ...], root: str = "spec") -> str:
    """A field path such as ``spec.consumers[0].layout.groups[1].kind``."""
    return field_path(loc, root)


def parse_spec(raw: Mapping[str, Any] | None) -> tuple[PoolSpec | None, list[Problem]]:
    """The typed spec, or the schema problems that prevent it."""
    try:
        return PoolSpec.model_validate(dict(raw or {})), []
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            message = error_message(error)
            problems.append(
                Problem(field=location(error["loc"]), rule=f"schema:{error['type']}", message=message)
            )
        return None, problems


def _problem(field: str, rule: str, message: str) -> Problem:
    return Problem(field=field, rule=rule, message=message)


def in_transfer_range(field: str, port: int) -> list[Problem]:
    """A master or store port among Mooncake's transfer ports, which the pool's NetworkPolicy
    opens to its granted consumers (the master's HTTP port there would expose its admin API)."""
    if not TRANSFER_PORT_MIN <= port <= TRANSFER_PORT_MAX:
        return []
    return [
        _problem(
            field,
            "transfer-port-range",
            f"port {port} is in {TRANSFER_PORT_MIN}-{TRANSFER_PORT_MAX}, Mooncake's transfer ports, "
            "which the pool's NetworkPolicy opens to its granted consumers: choose another",
        )
    ]


def check_master(spec: PoolSpec) -> list[Problem]:
    master = spec.master
    problems = []
    if master.ha.enabled:
        if master.replicas < 2:
            problems.append(
                _problem(
                    "spec.master.replicas",
                    "ha-replicas",
                    f"HA needs at least 2 masters, got {master.replicas}",
                )
            )
        if not master.ha.etcd_endpoints:
            problems.append(
                _problem("spec.master.ha.etcdEndpoints", "ha-etcd", "HA needs at least one etcd endpoint")
            )
    elif master.replicas != 1:
        problems.append(
            _problem(
                "spec.master.replicas",
                "single-master",
                f"without HA there is exactly one master, got {master.replicas}",
            )
        )
    problems += in_transfer_range("spec.master.rpcPort", master.rpc_port)
    problems += in_transfer_range("spec.master.metricsPort", master.metrics_port)
    if master.rpc_port == master.metrics_port:
        problems.append(
            _problem(
                "spec.master.metricsPort",
                "port-conflict",
                f"metrics port {master.metrics_port} is also the RPC port",
            )
        )
    return problems


def check_store(spec: PoolSpec) -> list[Problem]:
    if spec.store.mode != "standalone":
        if spec.store.disk_tier is not None:
            return [_problem("spec.store.diskTier", "disk-tier-store-pods", "a disk tier needs store pods")]
        return []
    problems = []
    if spec.store.replicas < 1:
        problems.append(
            _problem("spec.store.replicas", "store-replicas", "standalone mode needs at least one store pod")
        )
    problems += in_transfer_range("spec.store.port", spec.store.port)
    master_ports = {spec.master.rpc_port: "rpcPort", spec.master.metrics_port: "metricsPort"}
    if spec.store.port in master_ports:
        problems.append(
            _problem(
                "spec.store.port",
                "port-clash",
                f"store port {spec.store.port} equals spec.master.{master_ports[spec.store.port]}: "
                "the network policy opens the master's metrics port to spec.networkPolicy.metricsFrom",
            )
        )
    limit = store_memory_limit(spec)
    needed = spec.store.segment_size + STORE_MEMORY_OVERHEAD
    if limit is not None and limit < needed:
        problems.append(
            _problem(
                "spec.store.resources.limits.memory",
                "store-memory",
                f"memory limit {format_bytes(limit)} cannot hold the {format_bytes(spec.store.segment_size)} "
                f"segment plus the client's {format_bytes(STORE_MEMORY_OVERHEAD)} overhead: "
                f"set at least {format_bytes(needed)}",
            )
        )
    request = spec.store.resources.requests.get("memory")
    if limit is None and request is not None and parse_quantity(request) > needed:
        problems.append(
            _problem(
                "spec.store.resources.requests.memory",
                "request-over-limit",
                f"request {request} is above the memory limit the operator sets without one "
                f"({format_bytes(needed)}: the segment plus the client's overhead): set "
                "spec.store.resources.limits.memory too, or request less",
            )
        )
    return problems + check_disk_tier(spec)


# What ``spec.store`` may say of an external pool: how consumers reach the pool's memory, and
# whether each vLLM rank adds a segment (embedded). The rest describes store pods it never runs.
EXTERNAL_STORE_FIELDS = ("mode", "segmentSize", "protocol", "rdmaDevices")


def _refused_host(host: str) -> str | None:
    """Why the operator will not ask ``host``: an IP literal of its own pod or of a node's
    metadata service; None for any other address (a name is resolved by the cluster's DNS)."""
    try:
        address = unmapped(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return None
    if address.is_loopback or address.is_unspecified:
        return "a loopback or unspecified address (the operator's own pod)"
    if address.is_link_local or address.is_multicast:
        return "a link-local or multicast address (a node's metadata service, not a master)"
    return None


def check_external(spec: PoolSpec, raw: Mapping[str, Any]) -> list[Problem]:
    """An external pool: the image is needed only to run a master; an external pool runs no
    master and no store pods, so their fields are refused rather than ignored; the operator
    asks only master addresses that can be one."""
    problems = []
    if spec.external is None:
        if spec.image is None:
            problems.append(
                _problem("spec.image", "image-required", "a pool that runs its master needs an image")
            )
        return problems
    if "master" in raw:
        problems.append(
            _problem(
                "spec.master",
                "external-no-master",
                "an external pool runs no master: remove spec.master (spec.external names the master)",
            )
        )
    store = raw.get("store") or {}
    for key in sorted(set(store) - set(EXTERNAL_STORE_FIELDS)):
        problems.append(
            _problem(
                f"spec.store.{key}",
                "external-no-store-pods",
                "an external pool runs no store pods: remove it (only "
                + ", ".join(EXTERNAL_STORE_FIELDS)
                + " apply: how consumers reach the external pool's memory)",
            )
        )
    addresses = [("spec.external.masterServerAddress", spec.external.master_server_address)]
    addresses += [
        (f"spec.external.metricsEndpoints[{i}]", endpoint)
        for i, endpoint in enumerate(spec.external.metrics_endpoints)
    ]
    if spec.external.cluster_id and not spec.external.master_server_address.startswith("etcd://"):
        problems.append(
            _problem(
                "spec.external.clusterId",
                "cluster-id-needs-etcd",
                "a cluster id names an HA pool's leader election in etcd: it needs an etcd:// "
                "masterServerAddress",
            )
        )
    for where, address in addresses:
        hosts = address.removeprefix("etcd://").replace(";", ",").split(",")
        for host in hosts:
            reason = _refused_host(host.rsplit(":", 1)[0])
            if reason is not None:
                problems.append(
                    _problem(where, "external-address", f"{host!r} is {reason}: name the master's address")
                )
    return problems


def check_requests(spec: PoolSpec) -> list[Problem]:
    """A request above its limit: the API server would refuse every pod."""
    problems = []
    for component, resources in (("master", spec.master.resources), ("store", spec.store.resources)):
        problems += _requests_within_limits(f"spec.{component}.resources", resources)
    return problems


def _requests_within_limits(where: str, resources: ComputeResources) -> list[Problem]:
    problems = []
    for name, request in resources.requests.items():
        limit = resources.limits.get(name)
        if limit is not None and parse_quantity(request) > parse_quantity(limit):
            problems.append(
                _problem(
                    f"{where}.requests.{name}",
                    "request-over-limit",
                    f"request {request} is above the limit {limit}",
                )
            )
    return problems


def check_policy(spec: PoolSpec, policy: OperatorPolicy) -> list[Problem]:
    """What the admin's policy allows (``policy.policy_problems``)."""
    return policy_problems(spec, policy)


#: How long a consumer's load may go without progress before it gives up (the contract's
#: default; a pool's spec does not set it).
CONSUMER_LOAD_TIMEOUT_S: float = ConnectorSettings.model_fields["load_timeout_s"].default


def warnings(spec: PoolSpec) -> list[Problem]:
    """What may keep a valid pool from running (or serving hits): said, never refused."""
    out = []
    load_ms = CONSUMER_LOAD_TIMEOUT_S * 1000
    if spec.external is None and spec.master.lease_ttl_ms < load_ms:
        out.append(
            _problem(
                "spec.master.leaseTtlMs",
                "lease-shorter-than-load",
                f"a read still running {spec.master.lease_ttl_ms} ms after the master granted its "
                f"lease fails (the request recomputes), before the consumers' own load deadline "
                f"({CONSUMER_LOAD_TIMEOUT_S:g} s): a lease of at least {load_ms:g} ms keeps slow "
                "reads; a shorter one frees a full store's memory sooner (a disk tier)",
            )
        )
    if spec.store.mode == "standalone" and spec.store.protocol == "rdma":
        out.append(
            _problem(
                "spec.store.protocol",
                "pod-security-restricted",
                "RDMA store pods add the IPC_LOCK capability, which the restricted Pod Security "
                "Standard forbids: their namespace must enforce baseline or privileged",
            )
        )
    return out


def check_consumers(spec: PoolSpec) -> list[Problem]:
    return check_consumer_list(spec.consumers)


def check_consumer_list(consumers: Sequence[GrantConsumerSpec]) -> list[Problem]:
    """Consumers (a pool's or a grant's ``spec.consumers``): each once, each layout by the
    connector's own rules."""
    problems = []
    seen: set[str] = set()
    for index, consumer in enumerate(consumers):
        where = f"spec.consumers[{index}]"
        if consumer.name in seen:
            problems.append(
                _problem(f"{where}.name", "consumer-unique", f"consumer {consumer.name!r} is listed twice")
            )
        seen.add(consumer.name)
        for p in [*check(consumer.layout), *incomplete(consumer.layout)]:
            problems.append(
                _problem(f"{where}.layout.{p.field}", p.rule, f"consumer {consumer.name!r}: {p.message}")
            )
    return problems


def check_settings(
    pool: str, namespace: str, spec: PoolSpec
) -> tuple[ConnectorSettings | None, list[Problem]]:
    try:
        return pool_connector_settings(pool, namespace, spec), []
    except SettingsError as exc:
        return None, [
            _problem(spec_field_of(field), "connector-settings", message)
            for field, message in exc.problems.items()
        ]


def validate(
    pool: str, namespace: str, raw_spec: Mapping[str, Any] | None, policy: OperatorPolicy | None = None
) -> tuple[PoolSpec | None, ConnectorSettings | None, list[Problem]]:
    """The typed spec and settings, and every problem; usable only when there are none."""
    problems = []
    if len(pool) > names.MAX_POOL_NAME:
        problems.append(
            _problem(
                "metadata.name", "name-length", f"pool names are limited to {names.MAX_POOL_NAME} characters"
            )
        )
    spec, schema_problems = parse_spec(raw_spec)
    if spec is None:
        return None, None, problems + schema_problems
    problems += check_external(spec, raw_spec or {})
    if spec.external is None:
        problems += check_master(spec) + check_store(spec) + check_requests(spec)
    problems += check_consumers(spec) + check_tenancy(spec, namespace, policy or OperatorPolicy())
    problems += check_policy(spec, policy or OperatorPolicy())
    settings, settings_problems = check_settings(pool, namespace, spec)
    return spec, settings, problems + settings_problems


def check_tenancy(spec: PoolSpec, namespace: str = "", policy: OperatorPolicy | None = None) -> list[Problem]:
    """Grants need a master the pool runs, and mean nothing without tenancy; grants from other
    namespaces need stores of the pool's own and a namespace the operator watches."""
    if spec.tenancy.enabled and spec.external is not None:
        return [
            _problem(
                "spec.tenancy.enabled", "external-tenancy", "the operator runs no master of an external pool"
            )
        ]
    if spec.tenancy.enabled:
        return check_grant_namespaces(spec, namespace, policy or OperatorPolicy())
    off = [
        _problem(f"spec.consumers[{i}].grant", "tenancy-off", "a grant needs spec.tenancy.enabled")
        for i, consumer in enumerate(spec.consumers)
        if consumer.grant is not None
    ]
    if spec.tenancy.grant_namespaces:
        off.append(
            _problem(
                "spec.tenancy.grantNamespaces",
                "tenancy-off",
                "grants from other namespaces need spec.tenancy.enabled",
            )
        )
    return off


def check_grant_namespaces(spec: PoolSpec, namespace: str, policy: OperatorPolicy) -> list[Problem]:
    """``tenancy.grantNamespaces``: distinct, not the pool's own, watched by the operator, and
    not with embedded stores (whose consumers would have to reach each other across namespaces)."""
    listed = spec.tenancy.grant_namespaces
    problems = []
    for index, other in enumerate(listed):
        where = f"spec.tenancy.grantNamespaces[{index}]"
        if other == namespace:
            problems.append(_problem(where, "own-namespace", "the pool's own namespace needs no listing"))
        elif other in listed[:index]:
            problems.append(_problem(where, "duplicate", f"namespace {other} is listed twice"))
        elif policy.watched_namespaces and other not in policy.watched_namespaces:
            watched = ", ".join(policy.watched_namespaces)
            problems.append(
                _problem(
                    where,
                    "namespace-not-watched",
                    f"the operator watches only {watched}: it cannot read grants in {other}",
                )
            )
    if listed and not policy.network_policy_end_port:
        problems.append(
            _problem(
                "spec.tenancy.grantNamespaces",
                "end-port-needed",
                "the transfer ports other namespaces' consumers need are a port range (endPort), "
                "which this cluster's network plugin does not read (the operator's policy)",
            )
        )
    if listed and spec.store.mode == "embedded":
        problems.append(
            _problem(
                "spec.tenancy.grantNamespaces",
                "embedded-stores",
                "consumers in other namespaces need standalone stores (spec.store.mode standalone)",
            )
        )
    return problems


def describe(problems: list[Problem]) -> str:
    """One message naming every field and rule."""
    return "; ".join(str(p) for p in problems)


def _admitted(
    body: Mapping[str, Any], policy: OperatorPolicy | None
) -> tuple[PoolSpec | None, list[Problem]]:
    meta = body.get("metadata") or {}
    name = meta.get("name") or meta.get("generateName") or "pool"
    spec, _, problems = validate(name, meta.get("namespace") or "default", body.get("spec"), policy)
    return spec, problems


def admission_problems(body: Mapping[str, Any], policy: OperatorPolicy | None = None) -> str | None:
    """The webhook's verdict on a pool object: a message naming every field and rule, or None."""
    _, problems = _admitted(body, policy)
    return describe(problems) if problems else None


def admission_warnings(body: Mapping[str, Any], policy: OperatorPolicy | None = None) -> list[str]:
    """What the webhook tells the author of an admitted pool (``warnings``)."""
    spec, problems = _admitted(body, policy)
    return [str(w) for w in warnings(spec)] if spec is not None and not problems else []
