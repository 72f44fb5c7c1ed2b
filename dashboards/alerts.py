"""Prometheus alert rules for the pool, the connector and the operator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dashboards import external as ext
from dashboards.conventions import MASTER_JOB, MODEL, NAMESPACE, OPERATOR_JOB, OPERATOR_RELEASE, POOL
from dashboards.promql import by, ratio
from kvpool.connector.contract import metric_names as m
from kvpool.connector.pool_client import Outcome
from kvpool.operator import metric_names as o

# Each alert's runbook: its section of docs/runbooks.md, anchored by its name in lower case (as
# GitHub anchors a heading). Where that document is served is the installer's: the chart adds
# ``runbook_url`` (``monitoring.prometheusRule.runbookBaseUrl`` + ``#`` + the anchor).
RUNBOOKS_DOC = "docs/runbooks.md"  # in the repository

PER_POOL = [NAMESPACE, POOL]
PER_MODEL = [NAMESPACE, POOL, MODEL]
PER_GROUP = [NAMESPACE, POOL, MODEL, "group", "group_kind"]
# One engine: vLLM numbers each server's engines from 0, so its scrape target tells servers apart.
PER_ENGINE = [NAMESPACE, POOL, MODEL, "engine", "instance"]

# Thresholds (documented in each alert's description).
HIT_RATE_DROP = 0.5  # the group's hit rate fell below half of the hour before
HIT_RATE_FLOOR = 0.1  # ... and the hour before it was at least 10%
LOAD_ERROR_SHARE = 0.05  # more than 5% of load keys failed
LOOKUP_ERROR_SHARE = 0.05  # more than 5% of lookups failed
SAVE_ERROR_SHARE = 0.05  # more than 5% of the keys saves tried failed for a reason below
# Save failures that say nothing is wrong with the pool: another engine saving the same shared
# prefix at once (in_flight: its copy lands), the step's forward raised (forward_failed: vLLM's
# own error, the save never started), the pool or the tenant's quota full (store_full:
# KVPoolStoreFull's; quota_exceeded: the quota doing its job, the grant gauges show it).
BENIGN_SAVE_REASONS = (Outcome.IN_FLIGHT, Outcome.FORWARD_FAILED, Outcome.STORE_FULL, Outcome.QUOTA_EXCEEDED)
# A full pool evicts to make room: a save refused now and then is the design. More than 1% of
# the keys saves tried (or of the master's put starts) refused for room is eviction falling behind.
STORE_FULL_SHARE = 0.01
EVICTION_SPIKE = 3  # evictions three times the hour before ...
EVICTION_SHARE = 0.05  # ... and more than 5% of the pool's keys in 5 minutes
# An engine reports vllm:kvpool_in_pool when it steps, and vLLM steps an engine only while it
# has requests: an idle engine that joined its pool keeps exporting 0 until its next request.
# KVPoolEngineOutOfPool therefore fires only while the engine serves: vLLM counted prompt or
# generation tokens for it within this window. Shorter than the alert's 10 minutes, so an engine
# that went idle stops it pending before it fires.
SERVING_WINDOW = "5m"


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    duration: str
    severity: str
    summary: str
    description: str
    extra_labels: dict[str, str] = field(default_factory=dict)

    @property
    def runbook_anchor(self) -> str:
        """The alert's section of ``RUNBOOKS_DOC``."""
        return self.name.lower()

    def rule(self) -> dict[str, Any]:
        return {
            "alert": self.name,
            "expr": self.expr.strip() + "\n",
            "for": self.duration,
            "labels": {"severity": self.severity, **self.extra_labels},
            "annotations": {
                "summary": self.summary,
                "description": self.description,
            },
        }


def _sum_rate(metric: str, labels: list[str], window: str, sel: str = "", offset: str = "") -> str:
    off = f" offset {offset}" if offset else ""
    return f"sum{by(labels)} (rate({metric}{sel}[{window}]{off}))"


def _group_hit_rate(window: str, offset: str = "") -> str:
    """Each group's hit tokens over its model's looked-up tokens; none where none was looked up."""
    return ratio(
        _sum_rate(m.GROUP_HIT_TOKENS.exported, PER_GROUP, window, offset=offset),
        _sum_rate(m.LOOKUP_QUERY_TOKENS.exported, PER_MODEL, window, offset=offset),
        on=PER_MODEL,
        group_left=True,
    )


def _in_pool_rate(metric: str, sel: str, window: str) -> str:
    """``metric``'s rate per model, over the engines in the pool (one out of it is
    KVPoolEngineOutOfPool's: its lookups fail as rpc_failed until it joins). An engine is its
    scrape target's (``instance``): vLLM numbers the engines of each server from 0."""
    engine = ", ".join(PER_ENGINE)
    return (
        f"sum{by(PER_MODEL)} (\n  rate({metric}{sel}[{window}])\n"
        f"  unless on ({engine})\n  ({m.IN_POOL.exported} == 0)\n)"
    )


def _serving(counter: str) -> str:
    """The engines for which vLLM's ``counter`` (tokens its steps processed) moved within
    ``SERVING_WINDOW``."""
    return f"  sum{by(PER_ENGINE)} (increase({ext.total(counter)}[{SERVING_WINDOW}])) > 0"


def _failed_share(failed: str, moved: str, tried: str) -> str:
    """``failed`` over the keys tried: those ``moved`` plus those that failed (``tried``; zero
    keys moved when an engine moved none); none where none was tried (idle)."""
    return ratio(f"(\n{failed}\n)", f"(\n{tried}\n  + (\n{moved}\n  or\n{tried} * 0\n  )\n)")


def connector_alerts() -> list[Alert]:
    before = _group_hit_rate("1h", offset="10m")
    failed = _sum_rate(m.FAILURES.exported, PER_MODEL, "10m", f'{{operation="{m.LOAD}"}}')
    # Both in keys, every rank's (a tensor-parallel engine loads one key per rank and block).
    moved = _sum_rate(m.TRANSFER_KEYS.exported, PER_MODEL, "10m", f'{{operation="{m.LOAD}"}}')
    lookup_failed = _in_pool_rate(m.FAILURES.exported, f'{{operation="{m.LOOKUP}"}}', "10m")
    lookups = _in_pool_rate(m.LOOKUPS.exported, "", "10m")
    benign = "|".join(BENIGN_SAVE_REASONS)
    save = f'operation="{m.SAVE}"'
    save_failed = _sum_rate(m.FAILURES.exported, PER_MODEL, "10m", f'{{{save}, reason!~"{benign}"}}')
    save_tried = _sum_rate(m.FAILURES.exported, PER_MODEL, "10m", f"{{{save}}}")
    saved = _sum_rate(m.TRANSFER_KEYS.exported, PER_MODEL, "10m", f"{{{save}}}")
    return [
        Alert(
            "KVPoolGroupHitRateCollapse",
            f"(\n{_group_hit_rate('10m')}\n)\n< {HIT_RATE_DROP} * (\n{before}\n)\n"
            f"and (\n{before}\n) > {HIT_RATE_FLOOR}",
            "10m",
            "warning",
            "KV-cache group {{ $labels.group }} ({{ $labels.group_kind }}) of {{ $labels.model_name }} "
            "lost its pool hit rate",
            "Over the last 10 minutes group {{ $labels.group }} ({{ $labels.group_kind }}) of "
            "{{ $labels.model_name }} in {{ $labels.namespace }}/{{ $labels.pool }} hit "
            "{{ $value | humanizePercentage }} of looked-up tokens, less than half of the hour before. "
            "Check the Connector dashboard: a group whose presence drops while others keep theirs "
            "points at evictions or at a layout change (a new fingerprint starts a cold key space).",
        ),
        Alert(
            "KVPoolLoadErrorsRising",
            _failed_share(failed, moved, failed) + f"\n> {LOAD_ERROR_SHARE}",
            "10m",
            "warning",
            "Loads from the KV pool fail for {{ $labels.model_name }}",
            "{{ $value | humanizePercentage }} of the keys {{ $labels.model_name }} in "
            "{{ $labels.namespace }}/{{ $labels.pool }} loaded from the pool over 10 minutes failed, "
            "every tensor-parallel rank's keys counted "
            f"(threshold {LOAD_ERROR_SHARE:.0%}). vLLM recomputes those blocks, so output stays "
            "correct but the pool saves nothing. See 'Failed keys by kind' on the Connector dashboard.",
        ),
        Alert(
            "KVPoolLookupErrors",
            ratio(f"(\n{lookup_failed}\n)", lookups) + f"\n> {LOOKUP_ERROR_SHARE}",
            "10m",
            "warning",
            "Lookups in the KV pool fail for {{ $labels.model_name }}",
            "{{ $value | humanizePercentage }} of the lookups {{ $labels.model_name }} in "
            "{{ $labels.namespace }}/{{ $labels.pool }} made over 10 minutes failed (threshold "
            f"{LOOKUP_ERROR_SHARE:.0%}; engines out of the pool are KVPoolEngineOutOfPool's): the "
            "master did not answer in time (timeout) or could not be reached (rpc_failed). Each such "
            "lookup is a miss: vLLM computes the prefix itself. Check that the engines reach the "
            "master and that it is not overloaded; 'Failed keys by kind' on the Connector dashboard "
            "shows which.",
        ),
        Alert(
            "KVPoolSaveErrors",
            _failed_share(save_failed, saved, save_tried) + f"\n> {SAVE_ERROR_SHARE}",
            "10m",
            "warning",
            "Saves to the KV pool fail for {{ $labels.model_name }}",
            "{{ $value | humanizePercentage }} of the keys {{ $labels.model_name }} in "
            "{{ $labels.namespace }}/{{ $labels.pool }} tried to save over 10 minutes failed "
            f"(threshold {SAVE_ERROR_SHARE:.0%}), every tensor-parallel rank's keys counted; not "
            f"counted as failed: {', '.join(BENIGN_SAVE_REASONS)} (another engine saving the same "
            "prefix, vLLM's own forward error, a full pool: KVPoolStoreFull, a tenant at its quota: "
            "its grant's gauges). The pool "
            "misses those blocks later. 'Failed keys by kind' on the Connector dashboard names the "
            "reason (transfer_failed: the stores' transfer engine; rpc_failed or timeout: the master).",
        ),
        Alert(
            "KVPoolLayoutMismatch",
            f"sum{by(PER_ENGINE)} ({m.LAYOUT_MISMATCHES.exported}) > 0",
            "1m",
            "warning",
            "An engine of {{ $labels.model_name }} stays out of the KV pool: its declared layout is wrong",
            "Engine {{ $labels.engine }} of {{ $labels.model_name }} at {{ $labels.instance }} in "
            "{{ $labels.namespace }}/{{ $labels.pool }} built a KV layout that differs from the one "
            "its MooncakeKVPool declares in {{ $value }} field(s), so it serves without the pool. "
            "Its log names each field; kvpool-layout prints the right layout block for the consumer.",
        ),
        Alert(
            "KVPoolEngineOutOfPool",
            f"min{by(PER_ENGINE)} ({m.IN_POOL.exported}) == 0\n"
            f"unless on ({', '.join(PER_ENGINE)})\n"
            f"sum{by(PER_ENGINE)} ({m.LAYOUT_MISMATCHES.exported}) > 0\n"
            f"and on ({', '.join(PER_ENGINE)})\n"
            f"(\n{_serving(ext.VLLM_PROMPT_TOKENS)}\nor\n{_serving(ext.VLLM_GENERATION_TOKENS)}\n)",
            "10m",
            "warning",
            "An engine of {{ $labels.model_name }} serves without the KV pool",
            "Engine {{ $labels.engine }} of {{ $labels.model_name }} at {{ $labels.instance }} in "
            "{{ $labels.namespace }}/{{ $labels.pool }} has served without the pool for 10 minutes: "
            "its Mooncake master did not serve when the engine started, and the engine has not "
            "joined it since (it tries every 5 s; its log says why). Output stays correct; the engine "
            "computes every prefix itself. Check that the master serves and that the engine reaches it. "
            "An engine reports whether it is in the pool only when it steps, so the alert holds only "
            f"while the engine serves (vLLM counted tokens for it in the last {SERVING_WINDOW}): an idle "
            "engine that joined since its last request still exports 0 and is left alone.",
        ),
    ]


def pool_alerts() -> list[Alert]:
    up = f'{ext.UP}{{job="{MASTER_JOB}"}}'
    pool_by = f"({', '.join(PER_POOL)})"
    evicted_now = _sum_rate(ext.MASTER_EVICTED_KEYS, PER_POOL, "5m")
    evicted_before = _sum_rate(ext.MASTER_EVICTED_KEYS, PER_POOL, "1h", offset="5m")
    save = f'operation="{m.SAVE}"'
    store_full = _sum_rate(m.FAILURES.exported, PER_POOL, "5m", f'{{{save}, reason="{Outcome.STORE_FULL}"}}')
    save_tried = _sum_rate(m.FAILURES.exported, PER_POOL, "5m", f"{{{save}}}")
    saved = _sum_rate(m.TRANSFER_KEYS.exported, PER_POOL, "5m", f"{{{save}}}")
    put_starts = (
        f"{_sum_rate(ext.MASTER_PUT_STARTS, PER_POOL, '5m')}\n  + "
        f"{_sum_rate(ext.MASTER_BATCH_PUT_ITEMS, PER_POOL, '5m')}"
    )
    external = f'{o.POOL_INFO.exported}{{mode="{o.EXTERNAL}"}}'
    # The operator creates nothing for a pool whose spec is invalid (KVPoolConfigInvalid's).
    invalid = f'{o.POOL_CONDITION.exported}{{condition="ConfigValid", status="False"}}'
    # Pools that hold no memory by design: an embedded pool's memory is its consumers' vLLM
    # ranks' (none running, none mounted); a pool whose spec scales its store pods to zero.
    without_memory = (
        f'group by {pool_by} ({o.POOL_INFO.exported}{{mode="{o.EMBEDDED}"}})\n'
        f"  unless on {pool_by}\n  group by {pool_by} ({m.IN_POOL.exported})\n"
        f"or\n  group by {pool_by} ({o.POOL_STORES_EXPECTED.exported} == 0)"
    )
    return [
        Alert(
            "KVPoolMasterDown",
            f"max by {pool_by} ({up}) == 0\n"
            f"or\n"
            f"(\n  group by {pool_by} ({o.CONSUMERS.exported})\n"
            f"  unless on {pool_by}\n  {external}\n"
            f"  unless on {pool_by}\n  {invalid}\n"
            f"  unless on {pool_by}\n  ({up} == 1)\n)",
            "2m",
            "critical",
            "No Mooncake master of {{ $labels.namespace }}/{{ $labels.pool }} is up",
            "Prometheus reaches no master of pool {{ $labels.namespace }}/{{ $labels.pool }} (or the "
            "operator runs the pool's master and no master target exists). Lookups, loads and saves "
            "fail; vLLM keeps serving by recomputing. An external pool's master (spec.external) is "
            "not scraped: KVPoolError says when it does not serve; for a pool whose spec is invalid "
            "the operator runs no master: KVPoolConfigInvalid.",
        ),
        Alert(
            "KVPoolNoLeader",
            f"max by {pool_by} ({ext.MASTER_CAPACITY}) == 0\nand on {pool_by}\nmax by {pool_by} ({up}) == 1\n"
            f"unless on {pool_by}\n(\n  {without_memory}\n)",
            "3m",
            "critical",
            "No master of {{ $labels.namespace }}/{{ $labels.pool }} is serving the pool",
            "The masters of {{ $labels.namespace }}/{{ $labels.pool }} are up but none holds mounted "
            "store memory: with HA no leader was elected (check etcd), or no store mounted its "
            "segment at the current leader. An embedded pool none of whose vLLM engines runs "
            "(consumers scaled to zero), or a pool whose spec.store.replicas is 0, holds no memory "
            "by design and stays quiet.",
        ),
        Alert(
            "KVPoolStandbyFailed",
            f"max{by([*PER_POOL, 'instance'])} ({ext.HA_STANDBY_STATE}) == {ext.HA_STANDBY_FAILED}",
            "5m",
            "warning",
            "The HA standby {{ $labels.instance }} of {{ $labels.namespace }}/{{ $labels.pool }} failed",
            "The standby master {{ $labels.instance }} stopped replicating the leader's OpLog; a "
            "failover would lose the pool's metadata.",
        ),
        Alert(
            "KVPoolStoreFull",
            _failed_share(store_full, saved, save_tried)
            + f"\n> {STORE_FULL_SHARE}\nor\n"
            + ratio(_sum_rate(ext.MASTER_PUT_ALLOC_FAILURES, PER_POOL, "5m"), f"(\n  {put_starts}\n)")
            + f"\n> {STORE_FULL_SHARE}",
            "5m",
            "warning",
            "The KV pool {{ $labels.namespace }}/{{ $labels.pool }} is full",
            "Saves fail because the pool has no room ({{ $value | humanizePercentage }} of the keys "
            "the consumers tried to save, or of the puts the master started, refused over 5 minutes; "
            f"threshold {STORE_FULL_SHARE:.0%}) and eviction does not keep up. A full pool that evicts as "
            "designed refuses fewer. Add store memory (spec.store.segmentSize or replicas) or lower "
            "the eviction watermark.",
        ),
        Alert(
            "KVPoolEvictionSpike",
            f"{evicted_now}\n> {EVICTION_SPIKE} * (\n{evicted_before}\n  or\n{evicted_now} * 0\n)\n"
            f"and\nsum by {pool_by} (increase({ext.MASTER_EVICTED_KEYS}[5m]))\n"
            f"> {EVICTION_SHARE} * max by {pool_by} ({ext.MASTER_KEYS})",
            "5m",
            "warning",
            "Evictions spike in the KV pool {{ $labels.namespace }}/{{ $labels.pool }}",
            f"The master evicts {{{{ $value | humanize }}}} keys/s, more than {EVICTION_SPIKE} times the "
            f"hour before and over {EVICTION_SHARE:.0%} of the pool's keys in 5 minutes: the working "
            "set no longer fits, and hit rates will fall.",
        ),
    ]


def operator_alerts() -> list[Alert]:
    operator_up = f'{ext.UP}{{job="{OPERATOR_JOB}"}}'
    return [
        Alert(
            "KVPoolConfigInvalid",
            f"max by (namespace, pool) "
            f'({o.POOL_CONDITION.exported}{{condition="ConfigValid", status="False"}}) == 1',
            "1m",
            "warning",
            "MooncakeKVPool {{ $labels.namespace }}/{{ $labels.pool }} has ConfigValid=False",
            "The operator rejected a pool's spec or a consumer's KV layout and rolls nothing out for "
            "it. `kubectl get mooncakekvpools -A` and the pool's ConfigValid condition name each "
            "problem.",
        ),
        Alert(
            "KVPoolRolloutStuck",
            f"{o.CONSUMERS_ROLLED_OUT.exported} < {o.CONSUMERS.exported}",
            "15m",
            "warning",
            "Consumers of {{ $labels.namespace }}/{{ $labels.pool }} are not rolled out",
            "For 15 minutes only {{ $value }} of the pool's consumers run its current connector "
            "settings on all replicas. Check the consumer Deployments' rollout and the pool's "
            "ConsumersRolledOut condition.",
        ),
        Alert(
            "KVPoolDegraded",
            f'max by (namespace, pool) ({o.POOL_PHASE.exported}{{phase="Degraded"}}) == 1',
            "10m",
            "warning",
            "MooncakeKVPool {{ $labels.namespace }}/{{ $labels.pool }} has fewer stores than declared",
            "For 10 minutes fewer of the pool's store pods have mounted memory at its master than "
            "spec.store.replicas: it holds less and evicts sooner. The pool's Degraded condition "
            "names the store pods that mount nothing.",
        ),
        Alert(
            "KVPoolError",
            f'max by (namespace, pool) ({o.POOL_PHASE.exported}{{phase="Error"}}) == 1',
            "5m",
            "critical",
            "The master of MooncakeKVPool {{ $labels.namespace }}/{{ $labels.pool }} does not serve",
            "For 5 minutes the pool's master (its Deployment available, or the external master the "
            "pool names) has not answered the operator, has no leader or is not a Mooncake master: "
            "consumers recompute instead of hitting. The pool's Observed condition says which.",
        ),
        Alert(
            "KVPoolOperatorDown",
            # Per install: one release down while another serves is down all the same (its
            # replicas are one install: one of them up reconciles). None scraped at all: absent.
            f"max{by(OPERATOR_RELEASE)} ({operator_up}) == 0\nor\nabsent({operator_up})",
            "5m",
            "warning",
            "A kvpool operator is down",
            "Prometheus reaches no replica of the kvpool operator {{ $labels.service }} in namespace "
            "{{ $labels.namespace }} (both empty: no operator target at all): the pools it watches "
            "are not reconciled and its alerts (ConfigValid, rollouts) cannot fire.",
        ),
    ]


GROUPS = {
    "kvpool-connector": connector_alerts,
    "kvpool-pool": pool_alerts,
    "kvpool-operator": operator_alerts,
}


def all_alerts() -> list[Alert]:
    return [alert for make in GROUPS.values() for alert in make()]


def rules() -> dict[str, Any]:
    """The rules file: ``{"groups": [...]}``."""
    return {"groups": [{"name": name, "rules": [a.rule() for a in make()]} for name, make in GROUPS.items()]}
