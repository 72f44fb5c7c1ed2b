"""The ``MooncakeKVPool`` resource as pydantic models (the CRD schema is generated from them),
and the Kubernetes quantities (``"8Gi"``, ``"500M"``) its fields take.

The operator's own fields are camelCase, as usual in Kubernetes. The two blocks that
belong to the connector's contract keep the contract's own field names:
``connector`` (the fields of ``ConnectorSettings``, as in ``kv_connector_extra_config``)
and ``consumers[].layout`` (``KVLayout`` itself, vLLM's names).
"""

from __future__ import annotations

import re
from decimal import Decimal, DecimalException
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    create_model,
)
from pydantic.alias_generators import to_camel

from kvpool.connector.contract.layout import KVLayout
from kvpool.connector.contract.settings import CLUSTER_ID_PATTERN, ConnectorSettings, parse_size

# Kubernetes quantities: decimal and binary suffixes.
_SUFFIXES: dict[str, Decimal] = {
    "": Decimal(1),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}
MAX_QUANTITY = Decimal(2**63)
_QUANTITY_RE = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)([a-zA-Z]*)")


def parse_quantity(value: int | float | str) -> Decimal:
    """The numeric value of a Kubernetes quantity; ``ValueError`` if it is not one."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a quantity")
    if isinstance(value, int | float):
        number = Decimal(str(value))
    else:
        match = _QUANTITY_RE.fullmatch(value.strip())
        if not match or match.group(2) not in _SUFFIXES:
            raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. '8Gi', '500M')")
        try:
            number = Decimal(match.group(1)) * _SUFFIXES[match.group(2)]
        except DecimalException:
            raise ValueError(f"{value!r} is not a Kubernetes quantity") from None
    if not number.is_finite() or abs(number) >= MAX_QUANTITY:
        raise ValueError(f"{value!r} is beyond any resource quantity (at most 2**63-1)")
    return number


def format_bytes(size: int) -> str:
    """A byte count as the shortest exact binary quantity (``"4Gi"``, ``"1536Mi"``)."""
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = int(_SUFFIXES[suffix])
        if size and size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel)


def _check_quantity(value: int | str) -> int | str:
    parse_quantity(value)
    return value


Quantity = Annotated[int | str, AfterValidator(_check_quantity)]
Port = Annotated[int, Field(ge=1, le=65535)]
# Mooncake's transfer engine listens on ports in this range (its own default, pinned in every
# client). The pool's NetworkPolicy opens it on masters and stores to granted consumers, so no
# master or store port of its own may lie in it (the master's HTTP port serves an admin API).
TRANSFER_PORT_MIN = 15000
TRANSFER_PORT_MAX = 17000
DNSName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=253)]
NamespaceName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)]
#: A TCP port, 1-65535, as text (no leading zero).
PORT_TEXT = r"(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
Endpoint = Annotated[str, StringConstraints(pattern=rf"^[A-Za-z0-9.\-\[\]:]+:{PORT_TEXT}$")]
# Byte sizes take the contract's own parser: an integer, or a string such as "4GB" (binary units).
ByteSize = Annotated[int, BeforeValidator(parse_size, json_schema_input_type=int | str)]


class ComputeResources(_Model):
    """Compute resources of a container, as in a Pod."""

    limits: dict[str, Quantity] = Field(default_factory=dict)
    requests: dict[str, Quantity] = Field(default_factory=dict)


# Taint keys and node labels of the control plane's nodes: a pool never tolerates or selects
# them, whatever the admin's policy says (CEL rules in the CRD; ``policy`` checks them too).
CONTROL_PLANE_KEYS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")
_CONTROL_PLANE_LIST = "[" + ", ".join(f"'{key}'" for key in CONTROL_PLANE_KEYS) + "]"


def _cel(*rules: tuple[str, str]) -> dict[str, Any]:
    """``x-kubernetes-validations``: CEL rules the API server checks (rule, message)."""
    return {"x-kubernetes-validations": [{"rule": rule, "message": message} for rule, message in rules]}


#: A master or store port: outside the transfer range (``validation`` checks it too).
OUTSIDE_TRANSFER_RANGE = _cel(
    (
        f"self < {TRANSFER_PORT_MIN} || self > {TRANSFER_PORT_MAX}",
        f"must not be in {TRANSFER_PORT_MIN}-{TRANSFER_PORT_MAX} (Mooncake's transfer ports, which the "
        "pool's NetworkPolicy opens to its granted consumers)",
    )
)


class Toleration(_Model):
    """A Pod toleration (never of the control plane's taints, never of every taint)."""

    model_config = ConfigDict(
        **_Model.model_config,
        json_schema_extra=_cel(
            (
                f"!has(self.key) || !(self.key in {_CONTROL_PLANE_LIST})",
                "pools never tolerate the control plane's taints",
            ),
            (
                "(has(self.key) && self.key != '') || !has(self.operator) || self.operator != 'Exists'",
                "a toleration without a key tolerates every taint, the control plane's too",
            ),
        ),
    )

    # Bounded, as the CEL rules' cost must be (a label key: 253 + "/" + 63).
    key: Annotated[str, StringConstraints(max_length=317)] | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


Labels = Annotated[dict[str, str], Field(min_length=1)]
PriorityClassName = Annotated[
    str,
    StringConstraints(pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=253),
    Field(
        json_schema_extra=_cel(
            ("!self.startsWith('system-')", "the system- priority classes are reserved for the cluster's own")
        )
    ),
]
NodeSelector = Annotated[
    dict[str, str],
    Field(
        max_length=64,
        json_schema_extra=_cel(
            (
                " && ".join(f"!('{key}' in self)" for key in CONTROL_PLANE_KEYS),
                "pools never run on the control plane's nodes",
            )
        ),
    ),
]


class HASpec(_Model):
    """Master high availability: several masters elect a leader through etcd."""

    enabled: bool = False
    etcd_endpoints: list[Endpoint] = Field(
        default_factory=list, description="etcd endpoints (host:port); required when enabled."
    )
    etcd_pod_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Labels of the etcd pods, when they run in the pool's namespace: a NetworkPolicy "
        "then lets only this pool's pods (and the etcd members) reach them.",
    )
    replicate_index: bool = Field(
        default=True,
        description="The leader writes every change of the pool's index to etcd (Mooncake's "
        "OpLog, --enable_oplog) and the standbys replay it, so a failover keeps the pool's "
        "objects. Off: etcd only elects, and a new leader starts with an empty pool.",
    )
    cluster_id: str = Field(
        default="",
        pattern=CLUSTER_ID_PATTERN,
        description="The masters' Mooncake cluster id (--cluster_id), which names their leader "
        "election in etcd; stores and consumers are given it. Empty: <namespace>.<pool name>. "
        "Every pool sharing an etcd needs its own (set it when pools of several clusters share one).",
    )


class MasterSpec(_Model):
    """The Mooncake master (mooncake_master)."""

    replicas: int = Field(default=1, ge=1, le=2**31 - 1, description="1 without HA; at least 2 with HA.")
    ha: HASpec = Field(default_factory=HASpec)
    rpc_port: Port = Field(
        default=50051, description="Master RPC port.", json_schema_extra=OUTSIDE_TRANSFER_RANGE
    )
    metrics_port: Port = Field(
        default=9003,
        description="HTTP port of /metrics and /health.",
        json_schema_extra=OUTSIDE_TRANSFER_RANGE,
    )
    eviction_high_watermark_ratio: float = Field(
        default=0.95, gt=0, le=1, description="Pool usage that triggers eviction."
    )
    eviction_ratio: float = Field(default=0.05, gt=0, le=1, description="Share evicted at once.")
    lease_ttl_ms: int = Field(
        default=5000,
        ge=1,
        description="Default KV lease TTL (ms): how long a lookup or read keeps an object from "
        "removal and eviction. A read that outlasts it fails and the request recomputes: keep it "
        "at least the consumers' load_timeout_s (5 s by default). A full pool of leased objects "
        "refuses writes until their leases end.",
    )
    resources: ComputeResources = Field(
        default_factory=ComputeResources,
        description="Requests and limits; each one not given takes the operator's default "
        "(requests cpu 250m, memory 512Mi; limit memory 2Gi).",
    )
    node_selector: NodeSelector = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    priority_class_name: PriorityClassName | None = Field(default=None, description="Of the master pods.")
    extra_args: list[str] = Field(default_factory=list, description="More mooncake_master flags.")


class DiskTierVolumeSpec(_Model):
    """Where a store pod's disk tier lives: a volume of the pod's own, never a host path."""

    type: Literal["ephemeralClaim", "emptyDir"] = Field(
        default="ephemeralClaim",
        description="ephemeralClaim: a PersistentVolumeClaim made from a template for each store pod "
        "(a generic ephemeral volume, deleted with its pod); emptyDir: the node's scratch space.",
    )
    storage_class_name: DNSName | None = Field(
        default=None, description="ephemeralClaim: the storage class (default: the cluster's)."
    )
    size: ByteSize | None = Field(
        default=None,
        ge=1 << 20,
        description="The volume's size (default: the tier's capacity and a quarter more for "
        "Mooncake's bucket metadata).",
    )


class DiskTierSpec(_Model):
    """A local disk tier under each store pod's memory (Mooncake's offload; docs/tenancy.md):
    objects are written to the pod's volume and served from it after their memory is evicted."""

    capacity: ByteSize = Field(ge=1 << 20, description="Bytes the tier holds on each store pod.")
    key_limit: int = Field(default=1_000_000, ge=1, le=2**31 - 1, description="Objects the tier holds.")
    eviction_policy: Literal["none", "fifo", "lru"] = Field(
        default="lru", description="What the tier drops when full (none: it refuses new objects)."
    )
    high_watermark: float = Field(default=0.9, gt=0, le=1, description="Disk use that starts eviction.")
    low_watermark: float = Field(default=0.8, gt=0, lt=1, description="Disk use eviction stops at.")
    volume: DiskTierVolumeSpec = Field(default_factory=DiskTierVolumeSpec)


class StoreSpec(_Model):
    """Where the pool's memory comes from."""

    mode: Literal["standalone", "embedded"] = Field(
        default="standalone",
        description="standalone: store pods own the memory and vLLM contributes none; "
        "embedded: each vLLM rank contributes a segment and there are no store pods.",
    )
    replicas: int = Field(default=1, ge=0, le=2**31 - 1, description="Store pods (standalone mode).")
    segment_size: ByteSize = Field(
        default=4 << 30,
        ge=1 << 20,
        description="Memory each store pod (or vLLM rank, when embedded) contributes: "
        "bytes or a string like '4GB' (binary units).",
    )
    port: Port = Field(
        default=50052, description="Store client service port.", json_schema_extra=OUTSIDE_TRANSFER_RANGE
    )
    protocol: Literal["tcp", "rdma"] = "tcp"
    rdma_devices: list[str] = Field(default_factory=list, description="RDMA devices for rdma.")
    resources: ComputeResources = Field(
        default_factory=ComputeResources,
        description="Requests and limits; a memory limit must hold segmentSize plus the client's "
        "overhead (512Mi); without one, the operator sets exactly that. Without any CPU, the request "
        "is 250m.",
    )
    node_selector: NodeSelector = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    priority_class_name: PriorityClassName | None = Field(default=None, description="Of the store pods.")
    disk_tier: DiskTierSpec | None = Field(
        default=None, description="A local disk tier on each store pod (standalone mode)."
    )
    drain_timeout_seconds: int = Field(
        default=300,
        ge=0,
        le=86400,
        description="Before fewer store pods are applied, the master moves the leaving pods' objects "
        "to the others and sends them no new writes (a Mooncake drain job), for at most this long; "
        "0: no drain (the leaving pods' objects are lost). Changing it between 0 and more than 0 "
        "changes the store pods' readiness probe, so they restart one at a time and the pool "
        "refills.",
    )
    extra_args: list[str] = Field(default_factory=list, description="More mooncake_client flags.")


# The consumer-facing connector options, taken field by field from the contract's
# ConnectorSettings (same names, types, limits, descriptions). Addresses, protocol and
# segment sizes are not here: the operator derives them from the pool.
CONNECTOR_FIELDS = (
    "cache_prefix",
    "save_decode_cache",
    "batch_size",
    "local_buffer_size",
    "metadata_server",
    "transfer_threads",
    "load_batch_bytes",
    "idle_step_wait_s",
    "load_policy",
    "load_margin",
    "load_decision_min_samples",
    "allow_non_cryptographic_block_hash",
)


def _contract_field(name: str) -> tuple[Any, Any]:
    info = ConnectorSettings.model_fields[name]
    metadata = [
        BeforeValidator(parse_size, json_schema_input_type=int | str)
        if isinstance(item, BeforeValidator) and item.func is parse_size
        else item
        for item in info.metadata
    ]
    annotation = Annotated[(info.annotation, *metadata)] if metadata else info.annotation
    return annotation, Field(default=info.default, description=info.description)


ConnectorSpec: type[BaseModel] = create_model(
    "ConnectorSpec",
    __config__=ConfigDict(extra="forbid", frozen=True),
    __doc__="Connector settings every consumer gets (the contract's field names).",
    **{name: _contract_field(name) for name in CONNECTOR_FIELDS},
)


class GrantConsumerSpec(_Model):
    """A vLLM Deployment in the grant's namespace that uses the pool."""

    name: DNSName = Field(description="Deployment name.")
    container: DNSName | None = Field(
        default=None, description="The vLLM container; default: the Deployment's first."
    )
    kv_role: Literal["kv_both", "kv_producer", "kv_consumer"] = "kv_both"
    layout: KVLayout = Field(
        description="The KV-cache layout the model produces (kvpool-layout prints it); the connector "
        "stays out of the pool when vLLM builds another."
    )


class ConsumerSpec(GrantConsumerSpec):
    """A vLLM Deployment in the pool's namespace that uses the pool."""

    grant: DNSName | None = Field(
        default=None,
        description="The MooncakeKVPoolGrant in the consumer's own namespace it attaches with "
        "(required when spec.tenancy.enabled): its Mooncake tenant becomes the consumer's.",
    )


class ScraperSelector(_Model):
    """Pods allowed to reach the master's metrics port: both selectors must match."""

    namespace_selector: Labels = Field(description="Labels of the scraper's namespace.")
    pod_selector: Labels = Field(description="Labels of the scraper's pods.")


class NetworkPolicySpec(_Model):
    """Who may reach the pool's pods: masters, stores, and the consumers' transfer ports."""

    enabled: bool = True
    metrics_from: list[ScraperSelector] = Field(
        default_factory=list,
        description="Scraper pods also allowed to reach the master's metrics port. That port serves "
        "Mooncake's unauthenticated admin API besides /metrics (every key, segment status, "
        "remove_all): name the scraper's pods, never a whole namespace.",
    )


MasterServerAddress = Annotated[
    str,
    StringConstraints(
        pattern=rf"^(etcd://[A-Za-z0-9.\-\[\]:]+:{PORT_TEXT}([,;][A-Za-z0-9.\-\[\]:]+:{PORT_TEXT})*"
        rf"|[A-Za-z0-9.\-\[\]:]+:{PORT_TEXT})$",
        max_length=1024,
    ),
]


class ExternalSpec(_Model):
    """A Mooncake master the pool does not run: the operator starts no master and no store."""

    master_server_address: MasterServerAddress = Field(
        description="What consumers put in master_server_address: host:port of the master's RPC "
        "port, or etcd://host:port[,host:port...] for HA masters."
    )
    cluster_id: str = Field(
        default="",
        pattern=CLUSTER_ID_PATTERN,
        description="With an etcd:// address: the Mooncake cluster id of those masters (their "
        "--cluster_id), under which consumers find the leader. Empty: Mooncake's default.",
    )
    metrics_endpoints: list[Endpoint] = Field(
        default_factory=list,
        max_length=8,
        description="host:port of each master's HTTP port (--metrics_port): the operator asks "
        "/health and /metrics there for health and capacity (GET only, no redirects). Empty: "
        "nothing is observed and consumers are rolled without asking the master.",
    )


class TenancySpec(_Model):
    """Mooncake's multi-tenancy: the master admits each consumer's writes only within its
    grant's quota (docs/tenancy.md says what is and is not isolated)."""

    enabled: bool = Field(
        default=False,
        description="Run the master with --enable_multi_tenants and a quota per grant "
        "(MooncakeKVPoolGrant objects naming this pool); every consumer then names a grant.",
    )
    grant_changes: Literal["RestartMaster", "NextMasterStart"] = Field(
        default="RestartMaster",
        description="How a grant added, changed or removed reaches the master, which reads its "
        "quota policy only when it starts. RestartMaster: the master is rolled at once (the pool's "
        "objects are lost; consumers recompute while the cache refills). NextMasterStart: the "
        "policy waits for the master's next start; until then the master refuses a new grant's "
        "writes and keeps old quotas.",
    )
    grant_namespaces: list[NamespaceName] = Field(
        default_factory=list,
        max_length=256,
        description="Other namespaces whose grants (spec.poolNamespace naming this pool's) the pool "
        "honours; a grant anywhere else is refused (NamespaceNotAllowed). Their consumers' pods "
        "(labelled kvpool.mooncake.io/pool and kvpool.mooncake.io/pool-namespace) reach the "
        "master's RPC port and the stores' transfer ports, never the master's HTTP port.",
    )


class PoolSpec(_Model):
    """Desired state of a Mooncake KV-cache pool and its vLLM consumers."""

    image: str | None = Field(
        default=None,
        min_length=1,
        description="Image with mooncake_master, mooncake_client and python3 (the store pods run their "
        "wait for the master and their drain probe on it); required unless external.",
    )
    external: ExternalSpec | None = Field(
        default=None,
        description="An existing Mooncake master to use instead of running one (then spec.master, "
        "spec.image and store pods are not used).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    master: MasterSpec = Field(default_factory=MasterSpec)
    store: StoreSpec = Field(default_factory=StoreSpec)
    connector: ConnectorSpec = Field(default_factory=ConnectorSpec)  # type: ignore[valid-type]
    consumers: list[ConsumerSpec] = Field(default_factory=list)
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)
    tenancy: TenancySpec = Field(default_factory=TenancySpec)


class GrantSpec(_Model):
    """A share of a pool for the grant's namespace: one Mooncake tenant, one reuse domain."""

    pool: DNSName = Field(description="The MooncakeKVPool this grant is a share of.")
    pool_namespace: NamespaceName | None = Field(
        default=None,
        description="The pool's namespace (default: the grant's own); a pool in another namespace "
        "honours the grant only when its spec.tenancy.grantNamespaces lists the grant's namespace.",
    )
    ceiling: ByteSize = Field(
        ge=1 << 20,
        description="Pool memory the grant's consumers may hold at most (bytes or '8GB'); cut in "
        "proportion when the pool's grants ask more than its memory.",
    )
    reuse_domain: (
        Annotated[str, StringConstraints(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=40)] | None
    ) = Field(
        default=None,
        description="Grants that name the same domain are one tenant: their consumers share blocks "
        "and one quota, the largest of their ceilings. None: the grant is a tenant of its own.",
    )
    consumers: list[GrantConsumerSpec] = Field(
        default_factory=list,
        max_length=64,
        description="vLLM Deployments in the grant's namespace that use the pool, for a grant in "
        "another namespace than its pool's (the pool's own consumers are in its spec.consumers): "
        "the operator patches each, with its consent (labels kvpool.mooncake.io/allow-pool and "
        "kvpool.mooncake.io/allow-pool-namespace), as it patches the pool's own.",
    )


class GrantUsage(_Model):
    """The grant's tenant as the pool's master counts it, or why that is not known (never a zero)."""

    state: Literal["Observed", "Unknown"] = Field(
        description="Observed: the numbers below are the master's at changedAt. Unknown: the "
        "master was not asked, did not answer, or does not know the grant's tenant (reason)."
    )
    reason: str = Field(
        description="Answered, NotAsked, NotYet, Unreachable, NoLeader, NotAMaster, "
        "NoTenancyAtMaster or TenantNotAtMaster."
    )
    message: str = ""
    changed_at: str = Field(
        description="When the master first answered these numbers, or when they became unknown "
        "(a poll that finds them unchanged writes nothing)."
    )
    used: str = Field(description="Memory charged to the tenant and its share of the quota, or 'unknown'.")
    used_bytes: int | None = Field(
        default=None, description="Memory of the tenant's objects and of its reservations in flight."
    )
    used_percent: int | None = None
    quota: str | None = Field(default=None, description="The quota the master enforces, as a quantity.")
    quota_bytes: int | None = Field(
        default=None,
        description="The quota the master enforces: the policy's, cut when the quotas oversubscribe "
        "its memory (the master reads the policy when it starts: it may differ from ceilingBytes).",
    )
    requested_bytes: int | None = Field(default=None, description="The quota in the policy the master read.")
    over_quota: bool | None = Field(default=None, description="The tenant holds more than its quota.")
    admission_closed: bool | None = Field(default=None, description="The master admits no write of it.")
    rejected_writes: int | None = Field(
        default=None, description="Writes the master refused for the tenant's quota since it started."
    )
    evicted_bytes: int | None = Field(
        default=None, description="The tenant's bytes evicted for its own writes since the master started."
    )
    shared_with: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Other grants of the same tenant (a shared reuse domain): the numbers are the tenant's.",
    )


class HitTotals(_Model):
    """The hit rate some consumers report, together."""

    hit_rate: str = Field(description="Tokens the pool served over tokens looked up past the local hit.")
    hit_tokens: int
    looked_up_tokens: int


class GrantConsumerStatus(_Model):
    """Where one consumer the grant lists stands (what the pool's status says of it)."""

    name: str
    rolled_out: bool = False
    message: str = ""


class GrantStatus(_Model):
    """What the pool's master is told of a grant, and what it counts of it."""

    observed_generation: int | None = None
    tenant: str | None = Field(default=None, description="The Mooncake tenant of the grant's consumers.")
    master_server_address: str | None = Field(
        default=None,
        description="The pool's master_server_address: with the tenant, what a consumer the pool "
        "does not list (one in another namespace) puts in its connector settings.",
    )
    ceiling: str | None = Field(default=None, description="The ceiling the master admits, as a quantity.")
    ceiling_bytes: int | None = None
    usage: GrantUsage | None = None
    hits: HitTotals | None = Field(
        default=None,
        description="The hit rate its consumers report, as the pool's last poll of their /metrics "
        "found it (absent: none of its consumers' pods answered yet).",
    )
    consumers: list[GrantConsumerStatus] = Field(
        default_factory=list,
        description="The consumers the grant lists (another namespace's grant): rolled out, or "
        "why not (no consent, a Deployment another grant lists, the pool not serving).",
    )
    conditions: list[Condition] = Field(default_factory=list)


ConditionStatus = Literal["True", "False", "Unknown"]
# Each must be True for a Ready pool.
READY_CONDITIONS = ("ConfigValid", "MasterReady", "StoreReady", "ConsumersRolledOut")
# True while the pool leaves alone an object it would write: one it does not own, or a
# consumer that did not opt in.
CONFLICT = "Conflict"
# True while the pool carries the pause annotation: nothing is applied, rolled or patched.
PAUSED = "Paused"
# Whether the master's own numbers were read (True), could not be (False: the pool does not
# serve), or are not asked for (Unknown).
OBSERVED = "Observed"
# True while the pool serves with less than it declares (a store that mounts no memory).
DEGRADED = "Degraded"
CONDITION_TYPES = (*READY_CONDITIONS, CONFLICT, PAUSED, OBSERVED, DEGRADED)


class Condition(_Model):
    """One status condition."""

    type: str
    status: ConditionStatus
    reason: str
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class ConsumerStatus(_Model):
    """Where one consumer stands."""

    name: str
    config_hash: str | None = None
    layout_fingerprint: str | None = None
    rolled_out: bool = False
    message: str = ""


class StoreUsage(_Model):
    """One mounted segment as the master counts it."""

    segment: str = Field(description="The segment's name at the master (its transfer address).")
    pod: str | None = Field(default=None, description="The store pod whose IP the segment has.")
    capacity_bytes: int
    used_bytes: int


class PoolGrantUsage(_Model):
    """One grant's tenant as the master counts it (numbers absent: the master does not know it)."""

    grant: str
    tenant: str
    used: str = Field(description="Charged memory and its share of the quota, or 'unknown'.")
    used_bytes: int | None = None
    quota_bytes: int | None = Field(default=None, description="The quota the master enforces.")
    rejected_writes: int | None = None


class CapacityStatus(_Model):
    """The pool's memory and objects as its master counts them (``/metrics``)."""

    changed_at: str = Field(
        description="When the master first answered these numbers (a poll that finds them "
        "unchanged writes nothing; the Observed condition says whether it still answers)."
    )
    master: str = Field(description="The master that answered (its HTTP address).")
    capacity: str = Field(description="Mounted memory, as a quantity.")
    used: str = Field(description="Allocated memory, as a quantity, and its share of the capacity.")
    capacity_bytes: int
    used_bytes: int
    used_percent: int
    objects: int = Field(description="Objects (KV blocks) in the pool.")
    evictions: int = Field(description="Eviction passes since the master started.")
    evicted_objects: int = Field(description="Objects evicted since the master started.")
    evicted_bytes: int
    stores: str = Field(description="Store pods that mount memory, of those declared ('2/3').")
    stores_expected: int | None = None
    stores_mounted: int
    segments: list[StoreUsage] = Field(default_factory=list, max_length=1024)
    grants: list[PoolGrantUsage] | None = Field(
        default=None,
        max_length=1024,
        description="With tenancy: each accepted grant's tenant as the master counts it.",
    )


class ConsumerHits(_Model):
    """One consumer's hit rate, from its pods' own ``/metrics``."""

    name: str
    hit_rate: str = Field(description="Tokens the pool served over tokens looked up past the local hit.")
    hit_tokens: int
    looked_up_tokens: int
    pods: str = Field(description="Pods that answered, of the consumer's ready pods ('2/2').")
    problem: str | None = Field(default=None, description="Why a pod did not answer (the first).")
    grant: str | None = Field(
        default=None, description="The grant it uses (namespace/name in another namespace), with tenancy."
    )


class GrantHits(HitTotals):
    """The hit rate a grant's consumers report, together."""

    grant: str


class HitsStatus(_Model):
    """The hit rate the pool's consumers report, since each of their pods started."""

    changed_at: str = Field(description="When these numbers were first seen.")
    hit_rate: str = Field(description="Over every consumer: hit tokens over tokens looked up.")
    hit_tokens: int
    looked_up_tokens: int
    consumers: list[ConsumerHits] = Field(default_factory=list, max_length=1024)
    grants: list[GrantHits] = Field(
        default_factory=list, max_length=1024, description="Per grant, where tenancy is on."
    )


class ScaleDownStatus(_Model):
    """The last scale-down of the store pods, and what it loses."""

    at: str
    from_replicas: int
    to_replicas: int
    message: str


class StoreDrainStatus(_Model):
    """A scale-down of the store pods that waits for their drain (``store_drain`` module)."""

    state: Literal["Pending", "Draining", "Drained", "GivenUp", "Withdrawn"]
    from_replicas: int
    to_replicas: int
    started_at: str
    deadline: str
    job_id: str | None = Field(default=None, description="The master's drain job.")
    segments: list[str] = Field(default_factory=list, max_length=1024, description="Drained segments.")
    pods: list[str] = Field(default_factory=list, max_length=1024, description="Their store pods.")
    moved_objects: int = 0
    moved_bytes: int = 0
    message: str = ""


class PoolStatus(_Model):
    """Observed state of a pool."""

    observed_generation: int | None = None
    phase: Literal[
        "Pending", "Progressing", "Ready", "Degraded", "Error", "Invalid", "Conflict", "Paused"
    ] = "Pending"
    master_address: str | None = None
    capacity: CapacityStatus | None = None
    hits: HitsStatus | None = None
    last_scale_down: ScaleDownStatus | None = None
    store_drain: StoreDrainStatus | None = None
    conditions: list[Condition] = Field(default_factory=list)
    consumers: list[ConsumerStatus] = Field(default_factory=list)
    grants_from_other_namespaces: list[str] = Field(
        default_factory=list,
        description="The grants of spec.tenancy.grantNamespaces the pool serves (namespace/name).",
    )
    warnings: list[str] = Field(
        default_factory=list, description="What may keep the pool from running, though the spec is valid."
    )
