"""The Operator dashboard: reconciles, errors, durations, pools by condition, consumers rolled out."""

from __future__ import annotations

from dashboards.board import Board, Target, Variable
from dashboards.conventions import NAMESPACE, POOL, VAR_NAMESPACE, VAR_POOL, selector
from dashboards.promql import quantile, sum_rate
from kvpool.operator import metric_names as o

UID = "kvpool-operator"
SEL = selector(VAR_NAMESPACE, VAR_POOL)  # the per-pool gauges carry the pool's namespace and name


def build() -> Board:
    consumers = o.CONSUMERS.exported
    board = Board(
        UID,
        "KV pool / Operator",
        "The kvpool operator: reconcile passes, errors and durations, Kubernetes API writes, "
        "pools by condition and consumers rolled out.",
        [
            Variable(VAR_NAMESPACE, NAMESPACE, consumers),
            Variable(VAR_POOL, POOL, consumers, selector(VAR_NAMESPACE)),
        ],
    )
    conditions = o.POOL_CONDITION.exported

    board.row("Pools")
    board.stat(
        "Pools",
        "MooncakeKVPools the operator manages.",
        [Target(f"count({o.POOL_INFO.exported}{SEL}) or vector(0)")],
    )
    invalid = selector(VAR_NAMESPACE, VAR_POOL, condition="ConfigValid", status="False")
    board.stat(
        "ConfigValid false",
        "Pools whose spec or consumer layouts fail validation; nothing is rolled out for them.",
        [Target(f"count({conditions}{invalid}) or vector(0)")],
    )
    board.stat(
        "Consumers rolled out",
        "Consumers running their pool's current connector settings on all replicas, of those declared.",
        [
            Target(f"sum({o.CONSUMERS_ROLLED_OUT.exported}{SEL})", "rolled out"),
            Target(f"sum({consumers}{SEL})", "declared"),
        ],
    )
    board.stat(
        "Pools by mode",
        "managed: the operator runs the master and the store pods; embedded: it runs the master and "
        "the consumers' vLLM ranks hold the memory; external: spec.external names a master the "
        "operator does not run (the alerts on master targets leave these to KVPoolError).",
        [Target(f"sum by (mode) ({o.POOL_INFO.exported}{SEL})", "{{mode}}")],
    )
    board.timeseries(
        "Pools by condition",
        "How many pools have each condition (ConfigValid, MasterReady, StoreReady, "
        "ConsumersRolledOut) True, False or Unknown.",
        [Target(f"count by (condition, status) ({conditions}{SEL})", "{{condition}}={{status}}")],
    )
    board.timeseries(
        "Conditions per pool",
        "Each pool's conditions by name; a ConfigValid=False series is a rejected spec or consumer "
        "layout (the pool's status says which field and rule).",
        [
            Target(
                f"max by ({NAMESPACE}, {POOL}, condition, status) ({o.POOL_CONDITION.exported}{SEL})",
                "{{namespace}}/{{pool}} {{condition}}={{status}}",
            )
        ],
    )
    board.timeseries(
        "Consumers rolled out per pool",
        "Consumers on the pool's current settings, beside those declared; a gap that stays is a "
        "stuck rollout.",
        [
            Target(
                f"sum by ({NAMESPACE}, {POOL}) ({o.CONSUMERS_ROLLED_OUT.exported}{SEL})",
                "{{namespace}}/{{pool}} rolled out",
            ),
            Target(f"sum by ({NAMESPACE}, {POOL}) ({consumers}{SEL})", "{{namespace}}/{{pool}} declared"),
        ],
    )

    board.row("Reconciles")
    board.timeseries(
        "Reconciles per second by result",
        "Reconcile passes by trigger and result (success, invalid, error).",
        [Target(sum_rate(o.RECONCILES.exported, "", ["trigger", "result"]), "{{trigger}} {{result}}")],
        unit="ops",
    )
    board.timeseries(
        "Reconcile errors per second",
        "Failed passes by trigger and reason (http_<status> or the error type).",
        [Target(sum_rate(o.RECONCILE_ERRORS.exported, "", ["trigger", "reason"]), "{{trigger}} {{reason}}")],
        unit="ops",
    )
    board.timeseries(
        "Reconcile duration p50 and p99",
        "Duration of reconcile passes by trigger.",
        [
            Target(
                quantile(q, o.RECONCILE_DURATION.exported, "", ["trigger"]),
                f"p{int(q * 100)} {{{{trigger}}}}",
            )
            for q in (0.5, 0.99)
        ],
        unit="s",
    )
    board.timeseries(
        "Kubernetes API writes per second",
        "Writes by verb and resource; zero in a steady state.",
        [Target(sum_rate(o.API_WRITES.exported, "", ["verb", "resource"]), "{{verb}} {{resource}}")],
        unit="ops",
    )
    return board
