"""Metrics that are not ours: the Mooncake master's and vLLM's own.

Our metric names come from ``kvpool.connector.contract.metric_names`` and
``kvpool.operator.metric_names``; these are the others the dashboards show beside them.
The tests check every name here against a real master's ``/metrics`` and vLLM's own
metric definitions.
"""

from __future__ import annotations

# --- the Mooncake master (mooncake_master --metrics_port) -------------------------------
# Gauges.
MASTER_CAPACITY = "master_total_capacity_bytes"
MASTER_ALLOCATED = "master_allocated_bytes"
MASTER_KEYS = "master_key_count"
MASTER_SOFT_PIN_KEYS = "master_soft_pin_key_count"
MASTER_ACTIVE_CLIENTS = "master_active_clients"
SEGMENT_CAPACITY = "segment_total_capacity_bytes"  # label: segment
SEGMENT_ALLOCATED = "segment_allocated_bytes"  # label: segment
# Counters (some without the _total suffix: Mooncake names them so).
MASTER_EVICTIONS = "master_successful_evictions_total"
MASTER_EVICTION_ATTEMPTS = "master_attempted_evictions_total"
MASTER_EVICTED_KEYS = "master_evicted_key_count"
MASTER_EVICTED_BYTES = "master_evicted_size_bytes"
MASTER_PUT_ALLOC_FAILURES = "master_put_start_alloc_failures_total"  # per key
# Keys whose put the master started: one per PutStart, one per key of a BatchPutStart.
MASTER_PUT_STARTS = "master_put_start_requests_total"
MASTER_BATCH_PUT_ITEMS = "master_batch_put_start_items_total"

# RPCs the connector and the stores make, as (label, request counter, failure counter).
MASTER_REQUESTS: tuple[tuple[str, str, str], ...] = tuple(
    (rpc, f"master_{rpc}_requests_total", f"master_{rpc}_failures_total")
    for rpc in (
        "batch_exist_key",  # lookups
        "batch_put_start",  # saves
        "batch_put_end",
        "batch_put_revoke",
        "batch_get_replica_list",  # loads
        "exist_key",
        "put_start",
        "put_end",
        "get_replica_list",
        "remove",
        "mount_segment",
        "ping",  # client heartbeats
    )
)
MASTER_BATCH_PUT_FAILED_ITEMS = "master_batch_put_start_failed_items_total"
MASTER_BATCH_GET_FAILED_ITEMS = "master_batch_get_replica_list_failed_items_total"

# HA (``--enable_ha``): standby replication state and lag. A master exports these always.
HA_STANDBY_STATE = "ha_standby_state"
HA_STANDBY_LAG = "ha_oplog_standby_lag"
HA_OPLOG_LAST = "ha_oplog_last_sequence_id"
HA_OPLOG_APPLIED = "ha_oplog_applied_sequence_id"
HA_OPLOG_PENDING = "ha_oplog_pending_entries"
HA_PENDING_MUTATIONS = "ha_pending_mutation_queue_size"
HA_STANDBY_STATES = {
    0: "stopped",
    1: "connecting",
    2: "syncing",
    3: "watching",
    4: "recovering",
    5: "reconnecting",
    6: "promoting",
    7: "promoted",
    8: "failed",
}
HA_STANDBY_FAILED = 8

# --- vLLM's own (names as vLLM defines them; counters are scraped with _total) ----------
VLLM_PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
VLLM_PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
VLLM_EXTERNAL_PREFIX_CACHE_QUERIES = "vllm:external_prefix_cache_queries"
VLLM_EXTERNAL_PREFIX_CACHE_HITS = "vllm:external_prefix_cache_hits"
# Prompt tokens by where their KV came from (label ``source``): prefilled by the engine, taken
# from its own prefix cache, or loaded through the connector (from the pool).
VLLM_PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source"
PROMPT_COMPUTED, PROMPT_LOCAL_CACHE, PROMPT_LOADED = (
    "local_compute",
    "local_cache_hit",
    "external_kv_transfer",
)
VLLM_COUNTERS = (  # those the dashboards show
    VLLM_PREFIX_CACHE_QUERIES,
    VLLM_PREFIX_CACHE_HITS,
    VLLM_EXTERNAL_PREFIX_CACHE_QUERIES,
    VLLM_EXTERNAL_PREFIX_CACHE_HITS,
    VLLM_PROMPT_TOKENS_BY_SOURCE,
)
# Tokens an engine's steps processed: they move only while it serves (an alert reads them).
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens"
VLLM_GENERATION_TOKENS = "vllm:generation_tokens"


def total(counter: str) -> str:
    """The scraped name of a prometheus_client counter."""
    return f"{counter}_total"


# Prometheus' own per-target series.
UP = "up"
