"""The connector's Prometheus metrics: names, types, labels, help. One source.

Imports neither vLLM nor prometheus_client, so the dashboards generator and
the alert rules can import it. Every series also carries vLLM's own labels
(``model_name``, ``engine``). Label values are group indices, kinds and
operation names: never prompt text or token ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

PREFIX = "vllm:kvpool_"
VLLM_LABELS = ("model_name", "engine")

GROUP_LABELS = ("group", "group_kind")
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SIZE_BUCKETS = tuple(float(1 << p) for p in range(12, 34, 2))  # 4 KiB .. 8 GiB


class Kind(StrEnum):
    COUNTER = "counter"
    HISTOGRAM = "histogram"
    GAUGE = "gauge"


@dataclass(frozen=True)
class MetricSpec:
    """One metric as exported (counters without the ``_total`` suffix here)."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    @property
    def exported(self) -> str:
        """The series name as Prometheus scrapes it (counters end in ``_total``)."""
        return f"{self.name}_total" if self.kind is Kind.COUNTER else self.name


def _counter(short: str, help: str, labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(f"{PREFIX}{short}", Kind.COUNTER, help, labels)


LOOKUP_QUERY_TOKENS = _counter(
    "lookup_query_tokens", "Prompt tokens beyond the local cache hit that lookups asked the pool for."
)
LOOKUP_HIT_TOKENS = _counter(
    "lookup_hit_tokens", "Tokens the reconciled hybrid (HMA) hit granted from the pool."
)
LOOKUPS = _counter("lookups", "Scheduler lookups against the pool.")
LOOKUP_DEFERRED_STEPS = _counter(
    "lookup_deferred_steps",
    "Scheduler steps that skipped a request while its lookup was in flight (answered past the "
    "step's lookup_budget_ms): each delays the request's first token by one step of the "
    "others' forward. Over lookups, the mean deferral per request.",
)
GROUP_HIT_TOKENS = _counter(
    "group_hit_tokens",
    "Tokens each KV-cache group alone could have served from the pool (per-group hit).",
    GROUP_LABELS,
)
PRESENT_BLOCKS = _counter(
    "present_blocks",
    "Blocks of the looked-up prefix beyond the local cache hit present in the pool, per group.",
    GROUP_LABELS,
)
HIT_BLOCKS = _counter(
    "hit_blocks",
    "Blocks beyond the local cache hit that the reconciled hit needs from the pool, per group "
    "(after the group's mask; a hit recomputed as cheaper too, as lookup_hit_tokens).",
    GROUP_LABELS,
)
MASKED_BLOCKS = _counter(
    "masked_blocks",
    "Blocks a transfer covers but the group's mask leaves in place (load: outside the window "
    "or before the last Mamba state; save: no future hit could load them).",
    (*GROUP_LABELS, "operation"),
)
TRANSFER_BLOCKS = _counter(
    "transfer_blocks",
    "Blocks moved, per group (a save counts a block the pool already held: it is stored).",
    (*GROUP_LABELS, "operation"),
)
TRANSFER_BYTES = _counter(
    "transfer_bytes",
    "Bytes moved, per group (a save of a block the pool already held moves none).",
    (*GROUP_LABELS, "operation"),
)
TRANSFER_KEYS = _counter(
    "transfer_keys",
    "Keys moved, per group, by every rank: a tensor- or pipeline-parallel engine moves one key "
    "per rank and block (transfer_blocks counts each block once); a key several ranks read "
    "(replicated KV) counts once per rank. Failures count the same way: over this plus failures, "
    "the share of keys that failed.",
    (*GROUP_LABELS, "operation"),
)
FAILURES = _counter(
    "failures",
    "Keys whose transfer failed (on every rank), by kind (missing, store_full, transfer_failed, "
    "rpc_failed, timeout, corrupt, in_flight: a save found the key reserved by another writer, "
    "quota_exceeded and tenant_not_registered: the master refused a tenant's save, replica_unavailable: the "
    "master lists the object but no copy of it is readable, its store gone, forward_failed: "
    "a save not made because the step's forward raised, other_error); a "
    "lookup past its deadline counts as a timeout of group all, one whose existence check the "
    "master could not answer as a timeout or rpc_failed of group all.",
    (*GROUP_LABELS, "operation", "reason"),
)
REMOVED_OBJECTS = _counter(
    "removed_objects",
    "Pool objects the connector removed, by reason (corrupt: a loaded object that failed its header "
    "or payload check).",
    (*GROUP_LABELS, "reason"),
)
LOAD_ERROR_BLOCKS = _counter(
    "load_error_blocks", "Blocks whose load failed and that vLLM recomputes instead."
)
RECOMPUTED_REQUESTS = _counter(
    "recomputed_requests", "Requests a failed load sent back to recompute from their local state."
)
LAYOUT_MISMATCHES = _counter(
    "layout_mismatches",
    "Fields in which the KV layout declared for this engine differs from the one vLLM built, each "
    "counted once at start-up; an engine with any stays out of the pool.",
    ("field",),
)
IN_POOL = MetricSpec(
    f"{PREFIX}in_pool",
    Kind.GAUGE,
    "1 while this engine's scheduler uses the pool; 0 while the engine serves without it: its "
    "Mooncake master did not serve when it started (it joins once the master does) or its "
    "declared KV layout differs from the one vLLM built.",
)
LOAD_DECISIONS = _counter(
    "load_decisions",
    "Requests with a pool hit, by what the connector did (decision: load, recompute) and why "
    "(basis: estimate, the estimated load and recompute times compared; probe, recompute "
    "estimated faster but loaded to measure the link again; floor, too few "
    "observations to trust the rates, so it loads; forced, load_policy always).",
    ("decision", "basis"),
)
LOAD_SKIPPED_TOKENS = _counter(
    "load_skipped_tokens",
    "Pool-hit tokens recomputed instead of loaded because recomputing them was estimated faster "
    "(load_policy auto).",
)
LOAD_RATE = MetricSpec(
    f"{PREFIX}load_rate_bytes_per_second",
    Kind.GAUGE,
    "The load rate the load decision uses: bytes the workers loaded over their load time, "
    "learned online (decayed), per transport.",
    ("transport",),
)
PREFILL_RATE = MetricSpec(
    f"{PREFIX}prefill_rate_tokens_per_second",
    Kind.GAUGE,
    "The prefill rate the load decision uses: tokens the engine's prefilling steps computed over "
    "their wall time, learned online (decayed).",
)
#: The key fingerprint and every input it digests (``contract.identity.fingerprint_inputs``).
FINGERPRINT_LABELS = (
    "fingerprint",
    "layout_fingerprint",
    "model",
    "dtype",
    "groups",
    "hash_block_size",
    "parallel",
    "cache_dtype",
    "kv_quantization",
    "model_revision",
    "weight_quantization",
    "hf_overrides",
    "kv_cache_layout",
    "block_hash_algorithm",
    "pp_layer_partition",
    "block_hash_seed",
    "vllm_version",
    "model_dtype",
    "model_settings",
    "attention_kernel",
    "speculative",
)
KEY_FINGERPRINT_INFO = MetricSpec(
    f"{PREFIX}key_fingerprint_info",
    Kind.GAUGE,
    "Always 1: the fingerprint in this engine's pool keys and every input it digests. Engines "
    "share pool entries only when their fingerprints are equal; the other labels say why not.",
    FINGERPRINT_LABELS,
)
OPERATION_SECONDS = MetricSpec(
    f"{PREFIX}operation_seconds",
    Kind.HISTOGRAM,
    "Latency of lookups, and of each group's load and save per request, in seconds.",
    ("operation", "group_kind"),
    LATENCY_BUCKETS,
)
TRANSFER_SIZE_BYTES = MetricSpec(
    f"{PREFIX}transfer_size_bytes",
    Kind.HISTOGRAM,
    "Bytes one request's load or save moved (all groups).",
    ("operation",),
    SIZE_BUCKETS,
)

ALL: tuple[MetricSpec, ...] = (
    LOOKUPS,
    LOOKUP_DEFERRED_STEPS,
    LOOKUP_QUERY_TOKENS,
    LOOKUP_HIT_TOKENS,
    GROUP_HIT_TOKENS,
    PRESENT_BLOCKS,
    HIT_BLOCKS,
    MASKED_BLOCKS,
    TRANSFER_BLOCKS,
    TRANSFER_BYTES,
    TRANSFER_KEYS,
    FAILURES,
    REMOVED_OBJECTS,
    LOAD_ERROR_BLOCKS,
    RECOMPUTED_REQUESTS,
    LAYOUT_MISMATCHES,
    IN_POOL,
    LOAD_DECISIONS,
    LOAD_SKIPPED_TOKENS,
    KEY_FINGERPRINT_INFO,
    LOAD_RATE,
    PREFILL_RATE,
    OPERATION_SECONDS,
    TRANSFER_SIZE_BYTES,
)
BY_NAME = {spec.name: spec for spec in ALL}

# Operations and failure reasons, as label values.
LOOKUP, LOAD, SAVE, REMOVE = "lookup", "load", "save", "remove"
ALL_GROUPS_KIND = "all"

# prometheus_client >= 0.22 writes ``vllm:x`` samples as ``vllm_x`` when a scraper
# negotiates OpenMetrics (its HELP/TYPE lines keep the colon); Prometheus 2.x
# negotiates OpenMetrics by default. This scrape-time rule restores vLLM's
# names so dashboards and alerts see one name either way; the chart's
# ServiceMonitor and the tests' Prometheus both apply it.
VLLM_NAME_RELABEL: dict[str, object] = {
    "source_labels": ["__name__"],
    "regex": "vllm_(.+)",
    "target_label": "__name__",
    "replacement": "vllm:${1}",
    "action": "replace",
}
