"""The Pool dashboard: the Mooncake master's own metrics, per pool."""

from __future__ import annotations

from dashboards import external as ext
from dashboards.board import Board, Target, Variable
from dashboards.conventions import MASTER_JOB, NAMESPACE, POOL, VAR_NAMESPACE, VAR_POOL, selector
from dashboards.promql import ratio, sum_rate
from kvpool.operator import metric_names as o

UID = "kvpool-pool"
SEL = selector(VAR_NAMESPACE, VAR_POOL)
PER_POOL = [NAMESPACE, POOL]
PER_MASTER = [NAMESPACE, POOL, "instance"]
# The pools the variables list: those whose master Prometheus scrapes, and every pool the
# operator knows (an external pool's master is not scraped; its status panels still show it).
POOLS_LISTED = (ext.MASTER_CAPACITY, o.POOL_INFO.exported)


def pool_max(metric: str) -> str:
    """A pool's value of a master gauge: the serving master's (a standby reports zeros)."""
    return f"max by ({NAMESPACE}, {POOL}) ({metric}{SEL})"


def _total(metric: str) -> str:
    return f"sum({pool_max(metric)})"


def build() -> Board:
    board = Board(
        UID,
        "KV pool / Mooncake pool",
        "The Mooncake master of each pool: capacity, use, keys, evictions, clients, requests and "
        "failures, HA standby state and lag.",
        [
            Variable(VAR_NAMESPACE, NAMESPACE, POOLS_LISTED),
            Variable(VAR_POOL, POOL, POOLS_LISTED, selector(VAR_NAMESPACE)),
        ],
    )

    board.row("Capacity")
    board.stat(
        "Capacity", "Store memory mounted in the pool.", [Target(_total(ext.MASTER_CAPACITY))], "bytes"
    )
    board.stat(
        "Used",
        "Allocated over mounted memory; the master evicts above its high watermark.",
        [Target(ratio(_total(ext.MASTER_ALLOCATED), _total(ext.MASTER_CAPACITY)))],
        "percentunit",
    )
    board.stat("Keys", "Objects (KV blocks) in the pool.", [Target(_total(ext.MASTER_KEYS))])
    board.stat(
        "Active clients",
        "Store processes and vLLM workers with a live session at the master.",
        [Target(_total(ext.MASTER_ACTIVE_CLIENTS))],
    )
    board.timeseries(
        "Memory",
        "Allocated and mounted bytes per pool.",
        [
            Target(pool_max(ext.MASTER_ALLOCATED), "{{namespace}}/{{pool}} allocated"),
            Target(pool_max(ext.MASTER_CAPACITY), "{{namespace}}/{{pool}} capacity"),
        ],
        unit="bytes",
    )
    board.timeseries(
        "Use per store segment",
        "Allocated over capacity of each mounted segment (one per store process).",
        [
            Target(
                ratio(
                    f"sum by ({NAMESPACE}, {POOL}, segment) ({ext.SEGMENT_ALLOCATED}{SEL})",
                    f"sum by ({NAMESPACE}, {POOL}, segment) ({ext.SEGMENT_CAPACITY}{SEL})",
                ),
                "{{pool}} {{segment}}",
            )
        ],
        unit="percentunit",
        max_value=1,
    )
    board.timeseries(
        "Keys",
        "Objects in the pool, and those soft-pinned (evicted last).",
        [
            Target(pool_max(ext.MASTER_KEYS), "{{namespace}}/{{pool}} keys"),
            Target(pool_max(ext.MASTER_SOFT_PIN_KEYS), "{{namespace}}/{{pool}} soft-pinned"),
        ],
    )
    board.timeseries(
        "Active clients",
        "Clients with a live session at the master.",
        [Target(pool_max(ext.MASTER_ACTIVE_CLIENTS), "{{namespace}}/{{pool}}")],
    )

    board.row("Status (what the operator reads from the master)")
    board.stat(
        "Phase",
        "Each pool's phase: Degraded while fewer store pods mount memory than declared, Error "
        "while its master does not answer (kubectl get mkvp shows the same).",
        [
            Target(
                f"max by ({NAMESPACE}, {POOL}, phase) ({o.POOL_PHASE.exported}{SEL}) > 0",
                "{{pool}}: {{phase}}",
            )
        ],
        width=6,
    )
    board.stat(
        "Store drain",
        "A scale-down of the store pods waiting for the master to drain the leaving ones "
        "(status.storeDrain): Pending, Draining, Drained (they leave once not ready), GivenUp "
        "(the scale-down goes on and loses what they hold). Empty when none waits.",
        [
            Target(
                f"max by ({NAMESPACE}, {POOL}, state) ({o.POOL_STORE_DRAIN.exported}{SEL}) > 0",
                "{{pool}}: {{state}}",
            )
        ],
        width=6,
    )
    board.stat(
        "Store pods mounting memory",
        "Store pods whose segment the master counts, and those the spec declares.",
        [
            Target(f"sum({o.POOL_STORES_MOUNTED.exported}{SEL})", "mounted"),
            Target(f"sum({o.POOL_STORES_EXPECTED.exported}{SEL})", "declared"),
        ],
        width=6,
    )
    board.stat(
        "Objects in the status",
        "Objects the master counted at the operator's last poll (status.capacity.objects; "
        "external pools too).",
        [Target(f"sum({o.POOL_OBJECTS.exported}{SEL})")],
        width=6,
    )
    board.timeseries(
        "Capacity and use in the status",
        "Mounted and allocated memory as the operator last read them from each pool's master "
        "(status.capacity; external pools too, whose master Prometheus may not scrape).",
        [
            Target(
                f"max by ({NAMESPACE}, {POOL}) ({o.POOL_CAPACITY_BYTES.exported}{SEL})", "{{pool}} capacity"
            ),
            Target(f"max by ({NAMESPACE}, {POOL}) ({o.POOL_USED_BYTES.exported}{SEL})", "{{pool}} used"),
        ],
        unit="bytes",
        width=24,
        height=6,
    )
    per_consumer = f"{NAMESPACE}, {POOL}, consumer"
    board.timeseries(
        "Consumers' hit rate in the status",
        "Tokens the pool served over tokens each consumer looked up past its local hit, summed "
        "over its pods since each started, as the operator last read them from the pods' own "
        "/metrics (status.hits; kubectl get mkvp shows the pool's). No line while no pod of the "
        "consumer answers: unknown, not zero.",
        [
            Target(
                ratio(
                    f"max by ({per_consumer}) ({o.CONSUMER_HIT_TOKENS.exported}{SEL})",
                    f"max by ({per_consumer}) ({o.CONSUMER_LOOKED_UP_TOKENS.exported}{SEL})",
                ),
                "{{pool}}/{{consumer}}",
            )
        ],
        unit="percentunit",
        max_value=1,
        width=24,
        height=6,
    )

    board.row("Grants (what the operator reads from the master per tenant)")
    per_grant = f"{NAMESPACE}, {POOL}, grant"
    board.timeseries(
        "Memory per grant",
        "Memory the master charges to each grant's tenant (its objects and reservations in flight), "
        "and the quota it enforces (the grant's ceiling, cut when the grants oversubscribe the pool; "
        "kubectl get mkvpg shows the same). Grants of one reuse domain share one tenant's numbers. "
        "No line while the master does not answer or does not know the tenant: unknown, not zero.",
        [
            Target(f"max by ({per_grant}) ({o.GRANT_USED_BYTES.exported}{SEL})", "{{grant}} used"),
            Target(f"max by ({per_grant}) ({o.GRANT_QUOTA_BYTES.exported}{SEL})", "{{grant}} quota"),
        ],
        unit="bytes",
        width=8,
    )
    board.timeseries(
        "Use of quota per grant",
        "Charged over enforced quota of each grant's tenant; at its quota, a tenant's own oldest "
        "objects are evicted to admit its writes, and writes are refused while they are leased.",
        [
            Target(
                ratio(
                    f"max by ({per_grant}) ({o.GRANT_USED_BYTES.exported}{SEL})",
                    f"max by ({per_grant}) ({o.GRANT_QUOTA_BYTES.exported}{SEL})",
                ),
                "{{namespace}}/{{grant}}",
            )
        ],
        unit="percentunit",
        max_value=1,
        width=8,
    )
    board.timeseries(
        "Writes refused for quota per grant",
        "Writes the master refused for each grant's quota since it started (its own counter, "
        "as the operator last read it): a consumer that saves nothing more recomputes.",
        [
            Target(
                f"max by ({per_grant}) ({o.GRANT_REJECTED_WRITES.exported}{SEL})", "{{namespace}}/{{grant}}"
            )
        ],
        width=8,
    )
    board.timeseries(
        "Grants' hit rate in the status",
        "Tokens the pool served over tokens looked up past the local hit, summed over each grant's "
        "consumers whose pods answered, as the operator last read them from the pods' own /metrics "
        "(status.hits.grants; each grant's status.hits shows its own). No line while none of a "
        "grant's consumers answers: unknown, not zero.",
        [
            Target(
                ratio(
                    f"max by ({per_grant}) ({o.GRANT_HIT_TOKENS.exported}{SEL})",
                    f"max by ({per_grant}) ({o.GRANT_LOOKED_UP_TOKENS.exported}{SEL})",
                ),
                "{{namespace}}/{{grant}}",
            )
        ],
        unit="percentunit",
        max_value=1,
        width=24,
        height=6,
    )

    board.row("Evictions")
    board.timeseries(
        "Eviction passes per second",
        "Successful and attempted eviction passes.",
        [
            Target(sum_rate(ext.MASTER_EVICTIONS, SEL, PER_POOL), "{{namespace}}/{{pool}} successful"),
            Target(sum_rate(ext.MASTER_EVICTION_ATTEMPTS, SEL, PER_POOL), "{{namespace}}/{{pool}} attempted"),
        ],
        width=8,
    )
    board.timeseries(
        "Evicted keys per second",
        "Objects evicted to make room.",
        [Target(sum_rate(ext.MASTER_EVICTED_KEYS, SEL, PER_POOL), "{{namespace}}/{{pool}}")],
        width=8,
    )
    board.timeseries(
        "Evicted bytes per second",
        "Bytes evicted to make room.",
        [Target(sum_rate(ext.MASTER_EVICTED_BYTES, SEL, PER_POOL), "{{namespace}}/{{pool}}")],
        unit="binBps",
        width=8,
    )

    board.row("Requests")
    board.timeseries(
        "Master requests per second",
        "batch_exist_key: connector lookups; batch_put_*: saves; batch_get_replica_list: loads; "
        "ping: client heartbeats.",
        [Target(sum_rate(req, SEL, PER_POOL), f"{{{{pool}}}} {rpc}") for rpc, req, _ in ext.MASTER_REQUESTS],
        unit="reqps",
        width=24,
    )
    board.timeseries(
        "Master request failures per second",
        "Failed requests by RPC, and failed items inside batch requests (a batch put of a key "
        "that already exists counts as a failed item; a batch get of a missing key too).",
        [Target(sum_rate(fail, SEL, PER_POOL), f"{{{{pool}}}} {rpc}") for rpc, _, fail in ext.MASTER_REQUESTS]
        + [
            Target(
                sum_rate(ext.MASTER_BATCH_PUT_FAILED_ITEMS, SEL, PER_POOL), "{{pool}} batch_put_start items"
            ),
            Target(
                sum_rate(ext.MASTER_BATCH_GET_FAILED_ITEMS, SEL, PER_POOL),
                "{{pool}} batch_get_replica_list items",
            ),
        ],
        width=12,
    )
    board.timeseries(
        "Store full: allocation failures per second",
        "Puts the master could not place even after evicting: the pool is full (the connector "
        "counts these saves as store_full failures).",
        [Target(sum_rate(ext.MASTER_PUT_ALLOC_FAILURES, SEL, PER_POOL), "{{namespace}}/{{pool}}")],
        width=12,
    )

    board.row("High availability")
    board.timeseries(
        "Masters up and serving",
        "Up: master targets Prometheus reaches. Serving: masters holding mounted store memory; "
        "with HA exactly one (the leader), zero means no leader is serving the pool.",
        [
            Target(
                f"sum by ({NAMESPACE}, {POOL}) ({ext.UP}{selector(VAR_NAMESPACE, VAR_POOL, job=MASTER_JOB)})",
                "{{namespace}}/{{pool}} up",
            ),
            Target(
                f"sum by ({NAMESPACE}, {POOL}) ({ext.MASTER_CAPACITY}{SEL} > bool 0)",
                "{{namespace}}/{{pool}} serving",
            ),
        ],
        width=8,
    )
    board.stat(
        "Standby state",
        "Each master's HA standby service (a leader, or a master without HA, reports 'stopped').",
        [Target(f"max by ({', '.join(PER_MASTER)}) ({ext.HA_STANDBY_STATE}{SEL})", "{{pool}} {{instance}}")],
        width=8,
        height=8,
        mappings=ext.HA_STANDBY_STATES,
    )
    board.timeseries(
        "Standby lag",
        "OpLog entries a standby is behind the leader, entries waiting out of order, and "
        "mutations waiting for an etcd write retry.",
        [
            Target(
                f"max by ({', '.join(PER_MASTER)}) ({ext.HA_STANDBY_LAG}{SEL})", "{{pool}} {{instance}} lag"
            ),
            Target(
                f"max by ({', '.join(PER_MASTER)}) ({ext.HA_OPLOG_PENDING}{SEL})",
                "{{pool}} {{instance}} pending",
            ),
            Target(
                f"max by ({', '.join(PER_MASTER)}) ({ext.HA_PENDING_MUTATIONS}{SEL})",
                "{{pool}} {{instance}} mutation queue",
            ),
        ],
        width=8,
    )
    board.timeseries(
        "OpLog sequence",
        "Last OpLog entry the leader wrote and the last a standby applied.",
        [
            Target(
                f"max by ({', '.join(PER_MASTER)}) ({ext.HA_OPLOG_LAST}{SEL})",
                "{{pool}} {{instance}} written",
            ),
            Target(
                f"max by ({', '.join(PER_MASTER)}) ({ext.HA_OPLOG_APPLIED}{SEL})",
                "{{pool}} {{instance}} applied",
            ),
        ],
        width=24,
        height=6,
    )
    return board
