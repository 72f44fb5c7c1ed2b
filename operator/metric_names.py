"""The operator's Prometheus metrics: names, types, labels, help. One source.

Imports no prometheus_client, so the dashboards generator and the alert rules can
import it. It shares ``MetricSpec`` with ``kvpool.connector.contract.metric_names``
(counters are named without ``_total`` here; ``exported`` is the scraped name).
"""

from __future__ import annotations

from kvpool.connector.contract.metric_names import Kind, MetricSpec

PREFIX = "kvpool_operator_"
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


RECONCILES = MetricSpec(
    f"{PREFIX}reconciles",
    Kind.COUNTER,
    "Reconcile passes by trigger and result (success, invalid, error).",
    ("trigger", "result"),
)
RECONCILE_ERRORS = MetricSpec(
    f"{PREFIX}reconcile_errors",
    Kind.COUNTER,
    "Failed reconcile passes by trigger and reason (http_<status> or the error type).",
    ("trigger", "reason"),
)
RECONCILE_DURATION = MetricSpec(
    f"{PREFIX}reconcile_duration_seconds",
    Kind.HISTOGRAM,
    "Duration of reconcile passes in seconds.",
    ("trigger",),
    DURATION_BUCKETS,
)
API_WRITES = MetricSpec(
    f"{PREFIX}api_writes",
    Kind.COUNTER,
    "Kubernetes API writes by verb and resource (zero in a steady state).",
    ("verb", "resource"),
)
POOLS = MetricSpec(
    f"{PREFIX}pools",
    Kind.GAUGE,
    "Pools by condition (ConfigValid, MasterReady, StoreReady, ConsumersRolledOut) and status.",
    ("condition", "status"),
)
POOL_CONDITION = MetricSpec(
    f"{PREFIX}pool_condition",
    Kind.GAUGE,
    "1 for each pool's current status of each condition (so alerts can name the pool).",
    ("namespace", "pool", "condition", "status"),
)
CONSUMERS = MetricSpec(
    f"{PREFIX}consumers",
    Kind.GAUGE,
    "Consumers declared per pool.",
    ("namespace", "pool"),
)
CONSUMERS_ROLLED_OUT = MetricSpec(
    f"{PREFIX}consumers_rolled_out",
    Kind.GAUGE,
    "Consumers of a pool running its current settings on all replicas.",
    ("namespace", "pool"),
)

POOL_INFO = MetricSpec(
    f"{PREFIX}pool_info",
    Kind.GAUGE,
    "1 for each pool, with its mode: managed (the operator runs its master and store pods), "
    "embedded (the operator runs its master; the consumers' vLLM ranks hold the memory) or "
    "external (spec.external: a master the operator does not run, which its ServiceMonitor "
    "does not scrape).",
    ("namespace", "pool", "mode"),
)

# What each pool's status says its master counts (status.capacity), and its phase: also for
# external pools, whose master Prometheus may not scrape.
POOL_PHASE = MetricSpec(
    f"{PREFIX}pool_phase",
    Kind.GAUGE,
    "1 for each pool's current phase (Ready, Degraded, Error, Progressing, ...).",
    ("namespace", "pool", "phase"),
)
POOL_STORE_DRAIN = MetricSpec(
    f"{PREFIX}pool_store_drain",
    Kind.GAUGE,
    "1 while a scale-down of a pool's store pods waits for their drain, for its state (Pending, "
    "Draining, Drained, GivenUp, Withdrawn; status.storeDrain); no series when none waits.",
    ("namespace", "pool", "state"),
)
POOL_CAPACITY_BYTES = MetricSpec(
    f"{PREFIX}pool_capacity_bytes",
    Kind.GAUGE,
    "Memory mounted at the pool's master, as its status last observed it.",
    ("namespace", "pool"),
)
POOL_USED_BYTES = MetricSpec(
    f"{PREFIX}pool_used_bytes",
    Kind.GAUGE,
    "Memory allocated at the pool's master, as its status last observed it.",
    ("namespace", "pool"),
)
POOL_OBJECTS = MetricSpec(
    f"{PREFIX}pool_objects",
    Kind.GAUGE,
    "Objects (KV blocks) at the pool's master, as its status last observed it.",
    ("namespace", "pool"),
)
POOL_STORES_MOUNTED = MetricSpec(
    f"{PREFIX}pool_stores_mounted",
    Kind.GAUGE,
    "Store pods (or segments, without declared store pods) that mount memory at the master.",
    ("namespace", "pool"),
)
POOL_STORES_EXPECTED = MetricSpec(
    f"{PREFIX}pool_stores_expected",
    Kind.GAUGE,
    "Store pods the pool's spec declares (pools with store pods only).",
    ("namespace", "pool"),
)
OBSERVED_POOL_GAUGES = (
    POOL_CAPACITY_BYTES,
    POOL_USED_BYTES,
    POOL_OBJECTS,
    POOL_STORES_MOUNTED,
    POOL_STORES_EXPECTED,
)

# Each grant's tenant as the pool's master counts it (status.capacity.grants), while the
# master answers: no series when its numbers are not known (unknown, not zero). Labels are
# the grant's namespace (the pool's), pool and name: one series per grant.
GRANT_USED_BYTES = MetricSpec(
    f"{PREFIX}grant_used_bytes",
    Kind.GAUGE,
    "Memory the pool's master charges to a grant's tenant (its objects and reservations in flight).",
    ("namespace", "pool", "grant"),
)
GRANT_QUOTA_BYTES = MetricSpec(
    f"{PREFIX}grant_quota_bytes",
    Kind.GAUGE,
    "The quota the pool's master enforces for a grant's tenant (its ceiling, cut when oversubscribed).",
    ("namespace", "pool", "grant"),
)
GRANT_REJECTED_WRITES = MetricSpec(
    f"{PREFIX}grant_rejected_writes",
    Kind.GAUGE,
    "Writes the pool's master refused for a grant's quota since it started (its own counter).",
    ("namespace", "pool", "grant"),
)
OBSERVED_GRANT_GAUGES = (GRANT_USED_BYTES, GRANT_QUOTA_BYTES, GRANT_REJECTED_WRITES)

# What each consumer's pods report (status.hits): tokens looked up past the local hit and
# tokens the pool served, summed over the pods that answered, since each started.
CONSUMER_HIT_TOKENS = MetricSpec(
    f"{PREFIX}consumer_hit_tokens",
    Kind.GAUGE,
    "Tokens the pool served to a consumer's pods since each started, as its status last observed them.",
    ("namespace", "pool", "consumer"),
)
CONSUMER_LOOKED_UP_TOKENS = MetricSpec(
    f"{PREFIX}consumer_looked_up_tokens",
    Kind.GAUGE,
    "Tokens a consumer's pods looked up past their local hit since each started, as its status "
    "last observed them.",
    ("namespace", "pool", "consumer"),
)
CONSUMER_HIT_GAUGES = (CONSUMER_HIT_TOKENS, CONSUMER_LOOKED_UP_TOKENS)
# The same per grant (tenancy on): its consumers whose pods answered, together.
GRANT_HIT_TOKENS = MetricSpec(
    f"{PREFIX}grant_hit_tokens",
    Kind.GAUGE,
    "Tokens the pool served to a grant's consumers' pods since each started, as the pool's status "
    "last observed them.",
    ("namespace", "pool", "grant"),
)
GRANT_LOOKED_UP_TOKENS = MetricSpec(
    f"{PREFIX}grant_looked_up_tokens",
    Kind.GAUGE,
    "Tokens a grant's consumers' pods looked up past their local hit since each started, as the "
    "pool's status last observed them.",
    ("namespace", "pool", "grant"),
)
GRANT_HIT_GAUGES = (GRANT_HIT_TOKENS, GRANT_LOOKED_UP_TOKENS)

ALL: tuple[MetricSpec, ...] = (
    RECONCILES,
    RECONCILE_ERRORS,
    RECONCILE_DURATION,
    API_WRITES,
    POOLS,
    POOL_CONDITION,
    CONSUMERS,
    CONSUMERS_ROLLED_OUT,
    POOL_INFO,
    POOL_PHASE,
    POOL_STORE_DRAIN,
    *OBSERVED_POOL_GAUGES,
    *OBSERVED_GRANT_GAUGES,
    *CONSUMER_HIT_GAUGES,
    *GRANT_HIT_GAUGES,
)
BY_NAME = {spec.name: spec for spec in ALL}

# Label values.
TRIGGERS = ("create", "update", "resume", "resync", "delete")
RESULTS = ("success", "invalid", "error")
MANAGED, EMBEDDED, EXTERNAL = "managed", "embedded", "external"  # POOL_INFO's modes
