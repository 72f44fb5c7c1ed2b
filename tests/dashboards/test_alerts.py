"""The alert rules pass ``promtool check rules``, and ``promtool test rules`` shows each one
firing on a synthetic history that should fire it and staying quiet on one that should not;
those that divide stay quiet on an idle fleet, and none of their ratios reads NaN or ±Inf there."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import promql_parser
import pytest
import yaml

from dashboards import alerts, external, generate
from dashboards.conventions import MASTER_JOB, OPERATOR_JOB
from kvpool.connector.contract import metric_names as cm
from kvpool.operator import metric_names as om
from tests.dashboards.idle import IDLE_FLEETS, idle_history, non_finite

RULES_FILE = generate.ROOT / generate.CHART_FILES / generate.ALERTS_FILE
NS = "team-a"
MODEL = {"namespace": NS, "pool": "pool-a", "engine": "0"}


def promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.skip("promtool not installed: run scripts/setup.sh")
    return binary


def series(name: str, **labels: str) -> str:
    inner = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{name}{{{inner}}}"


def serving(labels: dict[str, str]) -> dict[str, str]:
    """vLLM's token counters of an engine that serves throughout (steps every minute)."""
    return {
        series(external.total(external.VLLM_PROMPT_TOKENS), **labels): "0+100x30",
        series(external.total(external.VLLM_GENERATION_TOKENS), **labels): "0+50x30",
    }


@dataclass
class Firing:
    labels: dict[str, str]
    value: str = ""  # $value as the annotation templates render it


@dataclass
class Case:
    """One promtool test: ``series`` (selector -> values), then alerts expected at each time."""

    alert: str
    series: dict[str, str]
    checks: dict[str, list[Firing]] = field(default_factory=dict)


def _render(template: str, labels: dict[str, str], value: str) -> str:
    text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), template)
    return re.sub(r"\{\{ \$value( \| \w+)? \}\}", value, text)


def cases() -> list[Case]:
    hybrid = {**MODEL, "model_name": "m"}
    g0 = {"group": "0", "group_kind": "full"}
    g1 = {"group": "1", "group_kind": "sliding_window"}
    load = {"operation": cm.LOAD, "reason": "missing"}
    lookup = {"operation": cm.LOOKUP, "group": cm.ALL_GROUPS_KIND, "group_kind": cm.ALL_GROUPS_KIND}
    two_a = {**MODEL, "model_name": "two", "instance": "a"}  # two replicas, engine "0" in each
    two_b = {**MODEL, "model_name": "two", "instance": "b"}
    save = {"operation": cm.SAVE}
    master = {"job": MASTER_JOB, "namespace": NS}
    op = {"job": OPERATOR_JOB, "instance": "operator:9090"}
    valid_false = {"condition": "ConfigValid", "status": "False", **op}
    release_a = {"job": OPERATOR_JOB, "namespace": "ops-a", "service": "kvpool-a"}
    release_b = {"job": OPERATOR_JOB, "namespace": "ops-b", "service": "kvpool-b"}
    release_c = {"job": OPERATOR_JOB, "namespace": "ops-c", "service": "kvpool-c"}
    prompt_tokens = external.total(external.VLLM_PROMPT_TOKENS)
    generation_tokens = external.total(external.VLLM_GENERATION_TOKENS)
    return [
        Case(
            "KVPoolGroupHitRateCollapse",
            {
                series(cm.LOOKUP_QUERY_TOKENS.exported, **hybrid): "0+1000x120",
                series(cm.GROUP_HIT_TOKENS.exported, **hybrid, **g0): "0+800x120",
                # group 1 stops hitting at minute 80
                series(cm.GROUP_HIT_TOKENS.exported, **hybrid, **g1): "0+800x80 64000x40",
            },
            {
                "75m": [],
                "110m": [Firing({"namespace": NS, "pool": "pool-a", "model_name": "m", **g1}, "0%")],
            },
        ),
        Case(
            "KVPoolLoadErrorsRising",
            {
                series(cm.FAILURES.exported, **hybrid, **g0, **load): "0+25x40",
                series(cm.TRANSFER_KEYS.exported, **hybrid, **g0, operation=cm.LOAD): "0+75x40",
                # 1% failed: quiet
                series(cm.FAILURES.exported, **MODEL, model_name="ok", **g0, **load): "0+1x40",
                series(
                    cm.TRANSFER_KEYS.exported, **MODEL, model_name="ok", **g0, operation=cm.LOAD
                ): "0+99x40",
                # tensor parallel 2: rank 1 fails every key, rank 0 moves its own; the blocks
                # (counted once) are as many as the failed keys, the keys tried twice as many
                series(cm.FAILURES.exported, **MODEL, model_name="tp", **g0, **load): "0+20x40",
                series(
                    cm.TRANSFER_KEYS.exported, **MODEL, model_name="tp", **g0, operation=cm.LOAD
                ): "0+20x40",
                series(
                    cm.TRANSFER_BLOCKS.exported, **MODEL, model_name="tp", **g0, operation=cm.LOAD
                ): "0+20x40",
                # every load failed, nothing moved at all
                series(cm.FAILURES.exported, **MODEL, model_name="none", **g0, **load): "0+10x40",
            },
            {
                "5m": [],
                "30m": [
                    Firing({"namespace": NS, "pool": "pool-a", "model_name": "m"}, "25%"),
                    Firing({"namespace": NS, "pool": "pool-a", "model_name": "none"}, "100%"),
                    Firing({"namespace": NS, "pool": "pool-a", "model_name": "tp"}, "50%"),
                ],
            },
        ),
        Case(
            "KVPoolLookupErrors",
            {
                # an engine partitioned from the master: every lookup fails
                series(cm.LOOKUPS.exported, **hybrid): "0+100x40",
                series(cm.FAILURES.exported, **hybrid, **lookup, reason="rpc_failed"): "0+100x40",
                series(cm.IN_POOL.exported, **hybrid): "1x40",
                # 1% timed out: quiet
                series(cm.LOOKUPS.exported, **MODEL, model_name="ok"): "0+100x40",
                series(cm.FAILURES.exported, **MODEL, model_name="ok", **lookup, reason="timeout"): "0+1x40",
                series(cm.IN_POOL.exported, **MODEL, model_name="ok"): "1x40",
                # never joined the pool: KVPoolEngineOutOfPool's, not this alert's
                series(cm.LOOKUPS.exported, **MODEL, model_name="out"): "0+100x40",
                series(
                    cm.FAILURES.exported, **MODEL, model_name="out", **lookup, reason="rpc_failed"
                ): "0+100x40",
                series(cm.IN_POOL.exported, **MODEL, model_name="out"): "0x40",
                # a healthy engine: lookups, no failure
                series(cm.LOOKUPS.exported, **MODEL, model_name="healthy"): "0+100x40",
                series(cm.IN_POOL.exported, **MODEL, model_name="healthy"): "1x40",
                # two replicas (engine "0" in each pod): one partitioned, one out of the pool
                series(cm.LOOKUPS.exported, **two_a): "0+100x40",
                series(cm.FAILURES.exported, **two_a, **lookup, reason="rpc_failed"): "0+100x40",
                series(cm.IN_POOL.exported, **two_a): "1x40",
                series(cm.LOOKUPS.exported, **two_b): "0+100x40",
                series(cm.FAILURES.exported, **two_b, **lookup, reason="rpc_failed"): "0+100x40",
                series(cm.IN_POOL.exported, **two_b): "0x40",
            },
            {
                "5m": [],
                "30m": [
                    Firing({"namespace": NS, "pool": "pool-a", "model_name": "m"}, "100%"),
                    Firing({"namespace": NS, "pool": "pool-a", "model_name": "two"}, "100%"),
                ],
            },
        ),
        Case(
            "KVPoolSaveErrors",
            {
                # 10% of the keys fail in the stores' transfer engine
                series(cm.TRANSFER_KEYS.exported, **hybrid, **g0, operation=cm.SAVE): "0+90x40",
                series(cm.FAILURES.exported, **hybrid, **g0, **save, reason="transfer_failed"): "0+10x40",
                # the master unreachable: nothing saved at all
                series(
                    cm.FAILURES.exported, **MODEL, model_name="down", **g0, **save, reason="rpc_failed"
                ): "0+20x40",
                # engines saving the same shared prefix at once: healthy
                series(
                    cm.TRANSFER_KEYS.exported, **MODEL, model_name="busy", **g0, operation=cm.SAVE
                ): "0+50x40",
                series(
                    cm.FAILURES.exported, **MODEL, model_name="busy", **g0, **save, reason="in_flight"
                ): "0+50x40",
                # forwards that raised, and a full pool (KVPoolStoreFull's): not this alert's
                series(
                    cm.TRANSFER_KEYS.exported, **MODEL, model_name="other", **g0, operation=cm.SAVE
                ): "0+40x40",
                series(
                    cm.FAILURES.exported, **MODEL, model_name="other", **g0, **save, reason="forward_failed"
                ): "0+30x40",
                series(
                    cm.FAILURES.exported, **MODEL, model_name="other", **g0, **save, reason="store_full"
                ): "0+30x40",
                # 2% failed: quiet
                series(
                    cm.TRANSFER_KEYS.exported, **MODEL, model_name="ok", **g0, operation=cm.SAVE
                ): "0+98x40",
                series(
                    cm.FAILURES.exported, **MODEL, model_name="ok", **g0, **save, reason="timeout"
                ): "0+2x40",
            },
            {
                "5m": [],
                "30m": [
                    Firing({"namespace": NS, "pool": "pool-a", "model_name": "m"}, "10%"),
                    Firing({"namespace": NS, "pool": "pool-a", "model_name": "down"}, "100%"),
                ],
            },
        ),
        Case(
            "KVPoolLayoutMismatch",
            {
                series(cm.LAYOUT_MISMATCHES.exported, **hybrid, field="groups[1].sliding_window"): "1x10",
                series(cm.LAYOUT_MISMATCHES.exported, **hybrid, field="dtype"): "1x10",
            },
            {"0m": [], "5m": [Firing({**MODEL, "model_name": "m"}, "2")]},
        ),
        Case(
            "KVPoolEngineOutOfPool",
            {
                **serving(hybrid),
                series(cm.IN_POOL.exported, **hybrid): "0x30",  # never joined, serving: fires
                **serving({**hybrid, "engine": "1"}),
                series(cm.IN_POOL.exported, **{**hybrid, "engine": "1"}): "0x5 1x25",  # joined
                # out of the pool by its layout: KVPoolLayoutMismatch says so, not this alert
                **serving({**hybrid, "engine": "2"}),
                series(cm.IN_POOL.exported, **{**hybrid, "engine": "2"}): "0x30",
                series(cm.LAYOUT_MISMATCHES.exported, **{**hybrid, "engine": "2"}, field="dtype"): "1x30",
                # started while the master was down, served three minutes, then idle: it joined
                # meanwhile, but with no step since it still exports 0 (the last value it sent)
                series(prompt_tokens, **{**hybrid, "engine": "3"}): "0 100 200 300x27",
                series(generation_tokens, **{**hybrid, "engine": "3"}): "0 10 20 30x27",
                series(cm.IN_POOL.exported, **{**hybrid, "engine": "3"}): "0x30",
                # out of the pool through long decodes that admit no new prompt: fires
                series(prompt_tokens, **{**hybrid, "engine": "4"}): "0x30",
                series(generation_tokens, **{**hybrid, "engine": "4"}): "0+50x30",
                series(cm.IN_POOL.exported, **{**hybrid, "engine": "4"}): "0x30",
            },
            {
                "5m": [],
                "9m": [],
                "12m": [
                    Firing({**MODEL, "model_name": "m"}, "0"),
                    Firing({**MODEL, "model_name": "m", "engine": "4"}, "0"),
                ],
                "25m": [
                    Firing({**MODEL, "model_name": "m"}, "0"),
                    Firing({**MODEL, "model_name": "m", "engine": "4"}, "0"),
                ],
            },
        ),
        Case(
            "KVPoolMasterDown",
            {
                series(external.UP, **master, pool="a", instance="a-master"): "1x4 0x10",
                series(external.UP, **master, pool="b", instance="b-master"): "1x15",
                series(om.CONSUMERS.exported, **op, namespace=NS, pool="b"): "1x15",
                # a pool the operator manages, with no master target at all
                series(om.CONSUMERS.exported, **op, namespace=NS, pool="c"): "1x15",
                series(om.POOL_INFO.exported, **op, namespace=NS, pool="c", mode=om.MANAGED): "1x15",
                # an external pool: its master is not scraped (KVPoolError covers it)
                series(om.CONSUMERS.exported, **op, namespace=NS, pool="d"): "1x15",
                series(om.POOL_INFO.exported, **op, namespace=NS, pool="d", mode=om.EXTERNAL): "1x15",
                # e: a new pool whose spec is invalid: the operator creates no master for it
                # (KVPoolConfigInvalid's case, not this one)
                series(om.CONSUMERS.exported, **op, namespace=NS, pool="e"): "0x15",
                series(om.POOL_INFO.exported, **op, namespace=NS, pool="e", mode=om.MANAGED): "1x15",
                series(om.POOL_CONDITION.exported, **valid_false, namespace=NS, pool="e"): "1x15",
            },
            {
                "1m": [],
                "10m": [Firing({"namespace": NS, "pool": "a"}), Firing({"namespace": NS, "pool": "c"})],
            },
        ),
        Case(
            "KVPoolNoLeader",
            {
                series(external.UP, **master, pool="a", instance="m1"): "1x15",
                series(external.UP, **master, pool="a", instance="m2"): "1x15",
                series(external.MASTER_CAPACITY, **master, pool="a", instance="m1"): "0x15",
                series(external.MASTER_CAPACITY, **master, pool="a", instance="m2"): "0x15",
                # b: a leader holds the memory, the standby reports zero
                series(external.UP, **master, pool="b", instance="m3"): "1x15",
                series(external.UP, **master, pool="b", instance="m4"): "1x15",
                series(external.MASTER_CAPACITY, **master, pool="b", instance="m3"): "1000000000x15",
                series(external.MASTER_CAPACITY, **master, pool="b", instance="m4"): "0x15",
                # c: the master is down (KVPoolMasterDown's case, not this one)
                series(external.UP, **master, pool="c", instance="m5"): "0x15",
                series(external.MASTER_CAPACITY, **master, pool="c", instance="m5"): "0x15",
                # d: embedded, its consumers scaled to zero: no vLLM rank holds memory, by design
                series(external.UP, **master, pool="d", instance="m6"): "1x15",
                series(external.MASTER_CAPACITY, **master, pool="d", instance="m6"): "0x15",
                series(om.POOL_INFO.exported, **op, namespace=NS, pool="d", mode=om.EMBEDDED): "1x15",
                # e: embedded, an engine runs and mounted nothing: no leader to mount at
                series(external.UP, **master, pool="e", instance="m7"): "1x15",
                series(external.MASTER_CAPACITY, **master, pool="e", instance="m7"): "0x15",
                series(om.POOL_INFO.exported, **op, namespace=NS, pool="e", mode=om.EMBEDDED): "1x15",
                series(cm.IN_POOL.exported, **{**MODEL, "pool": "e"}, model_name="m"): "0x15",
                # f: managed, its stores scaled to zero (spec.store.replicas 0): no memory, by design
                series(external.UP, **master, pool="f", instance="m8"): "1x15",
                series(external.MASTER_CAPACITY, **master, pool="f", instance="m8"): "0x15",
                series(om.POOL_INFO.exported, **op, namespace=NS, pool="f", mode=om.MANAGED): "1x15",
                series(om.POOL_STORES_EXPECTED.exported, **op, namespace=NS, pool="f"): "0x15",
                # g: managed, one store declared and none mounted at the master
                series(external.UP, **master, pool="g", instance="m9"): "1x15",
                series(external.MASTER_CAPACITY, **master, pool="g", instance="m9"): "0x15",
                series(om.POOL_INFO.exported, **op, namespace=NS, pool="g", mode=om.MANAGED): "1x15",
                series(om.POOL_STORES_EXPECTED.exported, **op, namespace=NS, pool="g"): "1x15",
            },
            {
                "2m": [],
                "10m": [
                    Firing({"namespace": NS, "pool": "a"}),
                    Firing({"namespace": NS, "pool": "e"}),
                    Firing({"namespace": NS, "pool": "g"}),
                ],
            },
        ),
        Case(
            "KVPoolStandbyFailed",
            {
                series(external.HA_STANDBY_STATE, **master, pool="a", instance="s1"): "8x15",
                series(external.HA_STANDBY_STATE, **master, pool="a", instance="s2"): "3x15",
            },
            {"2m": [], "10m": [Firing({"namespace": NS, "pool": "a", "instance": "s1"})]},
        ),
        Case(
            "KVPoolStoreFull",
            {
                # pool-a: every save refused for room
                series(
                    cm.FAILURES.exported, **hybrid, **g0, operation=cm.SAVE, reason="store_full"
                ): "0+60x15",
                # b: the master refuses a fifth of the puts it starts (batched and single)
                series(external.MASTER_PUT_ALLOC_FAILURES, **master, pool="b", instance="m"): "0+120x15",
                series(external.MASTER_BATCH_PUT_ITEMS, **master, pool="b", instance="m"): "0+500x15",
                series(external.MASTER_PUT_STARTS, **master, pool="b", instance="m"): "0+100x15",
                series(external.MASTER_PUT_ALLOC_FAILURES, **master, pool="c", instance="m"): "0x15",
                series(external.MASTER_BATCH_PUT_ITEMS, **master, pool="c", instance="m"): "0+500x15",
                series(external.MASTER_PUT_STARTS, **master, pool="c", instance="m"): "0x15",
                # d: a full pool evicting as designed: 1 key in 200 refused, by the consumers and
                # by the master
                series(
                    cm.FAILURES.exported,
                    **{**MODEL, "pool": "d"},
                    model_name="m",
                    **g0,
                    operation=cm.SAVE,
                    reason="store_full",
                ): "0+1x15",
                series(
                    cm.TRANSFER_KEYS.exported,
                    **{**MODEL, "pool": "d"},
                    model_name="m",
                    **g0,
                    operation=cm.SAVE,
                ): "0+199x15",
                series(external.MASTER_PUT_ALLOC_FAILURES, **master, pool="d", instance="m"): "0+1x15",
                series(external.MASTER_BATCH_PUT_ITEMS, **master, pool="d", instance="m"): "0+200x15",
                series(external.MASTER_PUT_STARTS, **master, pool="d", instance="m"): "0x15",
            },
            {
                "2m": [],
                "10m": [
                    Firing({"namespace": NS, "pool": "pool-a"}, "100%"),
                    Firing({"namespace": NS, "pool": "b"}, "20%"),
                ],
            },
        ),
        Case(
            "KVPoolEvictionSpike",
            {
                # a: 10 keys a minute for an hour, then 1000 a minute
                series(
                    external.MASTER_EVICTED_KEYS, **master, pool="a", instance="m"
                ): "0+10x60 1600+1000x25",
                series(external.MASTER_KEYS, **master, pool="a", instance="m"): "5000x85",
                series(external.MASTER_EVICTED_KEYS, **master, pool="b", instance="m"): "0+10x85",
                series(external.MASTER_KEYS, **master, pool="b", instance="m"): "5000x85",
            },
            {"60m": [], "80m": [Firing({"namespace": NS, "pool": "a"}, "16.67")]},
        ),
        Case(
            "KVPoolConfigInvalid",
            {
                series(om.POOL_CONDITION.exported, **valid_false, namespace=NS, pool="a"): "1x10",
                series(
                    om.POOL_CONDITION.exported, **{**valid_false, "status": "True"}, namespace=NS, pool="b"
                ): "1x10",
            },
            {"5m": [Firing({"namespace": NS, "pool": "a"}, "1")]},
        ),
        Case(
            "KVPoolConfigInvalid",
            {
                series(
                    om.POOL_CONDITION.exported, **{**valid_false, "status": "True"}, namespace=NS, pool="a"
                ): "1x10"
            },
            {"5m": []},
        ),
        Case(
            "KVPoolRolloutStuck",
            {
                series(om.CONSUMERS.exported, **op, namespace=NS, pool="a"): "2x30",
                series(om.CONSUMERS_ROLLED_OUT.exported, **op, namespace=NS, pool="a"): "1x30",
                series(om.CONSUMERS.exported, **op, namespace=NS, pool="b"): "2x30",
                series(om.CONSUMERS_ROLLED_OUT.exported, **op, namespace=NS, pool="b"): "2x30",
            },
            {"10m": [], "20m": [Firing({"namespace": NS, "pool": "a", **op}, "1")]},
        ),
        Case(
            "KVPoolDegraded",
            {
                series(om.POOL_PHASE.exported, **op, namespace=NS, pool="a", phase="Degraded"): "1x20",
                series(om.POOL_PHASE.exported, **op, namespace=NS, pool="b", phase="Ready"): "1x20",
                # c: a store down for a moment (a store pod restarting), then back
                series(om.POOL_PHASE.exported, **op, namespace=NS, pool="c", phase="Degraded"): "1x3 0x16",
            },
            {"5m": [], "15m": [Firing({"namespace": NS, "pool": "a"}, "1")]},
        ),
        Case(
            "KVPoolError",
            {
                series(om.POOL_PHASE.exported, **op, namespace=NS, pool="a", phase="Error"): "1x10",
                series(om.POOL_PHASE.exported, **op, namespace=NS, pool="b", phase="Degraded"): "1x10",
            },
            {"2m": [], "8m": [Firing({"namespace": NS, "pool": "a"}, "1")]},
        ),
        Case(
            "KVPoolOperatorDown",
            {
                # two releases, each its own namespace and Service: b's operator is down
                series(external.UP, **release_a, instance="10.0.0.1:8080"): "1x10",
                series(external.UP, **release_b, instance="10.0.0.2:8080"): "0x10",
                # c runs two replicas (leader election): one down, the other reconciles
                series(external.UP, **release_c, instance="10.0.0.3:8080"): "0x10",
                series(external.UP, **release_c, instance="10.0.0.4:8080"): "1x10",
            },
            {"3m": [], "6m": [Firing({"namespace": "ops-b", "service": "kvpool-b"})]},
        ),
        Case(
            "KVPoolOperatorDown",
            {series(external.UP, **release_a, instance="10.0.0.1:8080"): "0x10"},
            {"6m": [Firing({"namespace": "ops-a", "service": "kvpool-a"})]},
        ),
        # no operator target at all
        Case(
            "KVPoolOperatorDown",
            {series(external.UP, **master, pool="a", instance="m"): "1x10"},
            {"6m": [Firing({"job": OPERATOR_JOB})]},
        ),
        Case(
            "KVPoolOperatorDown",
            {series(external.UP, **release_a, instance="10.0.0.1:8080"): "1x10"},
            {"6m": []},
        ),
    ]


def promtool_tests() -> dict:
    by_name = {a.name: a for a in alerts.all_alerts()}
    tests = []
    for case in cases():
        alert = by_name[case.alert]
        checks = []
        for time, firing in case.checks.items():
            expected = []
            for f in firing:
                labels = {"severity": alert.rule()["labels"]["severity"], **f.labels}
                annotations = {k: _render(v, labels, f.value) for k, v in alert.rule()["annotations"].items()}
                expected.append({"exp_labels": labels, "exp_annotations": annotations})
            checks.append({"eval_time": time, "alertname": case.alert, "exp_alerts": expected})
        tests.append(
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in case.series.items()],
                "alert_rule_test": checks,
            }
        )
    return {"rule_files": [str(RULES_FILE)], "evaluation_interval": "1m", "tests": tests}


def test_promtool_checks_the_rules() -> None:
    result = subprocess.run(
        [promtool(), "check", "rules", str(RULES_FILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts.all_alerts())} rules found" in result.stdout


def test_every_alert_fires_and_stays_quiet_in_promtool(tmp_path: Path) -> None:
    fired = {c.alert for c in cases() if any(c.checks.values())}
    quiet = {c.alert for c in cases() if any(not f for f in c.checks.values())}
    names = {a.name for a in alerts.all_alerts()}
    assert fired == names and quiet == names
    path = tmp_path / "alerts_test.yaml"
    path.write_text(yaml.safe_dump(promtool_tests(), sort_keys=False))
    result = subprocess.run(
        [promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def divisions(expr: str) -> list[str]:
    """Every ``a / b`` in ``expr``, as PromQL text."""
    found: list[str] = []

    def visit(node: object) -> bool:
        if isinstance(node, promql_parser.BinaryExpr) and str(node.op) == "/":
            found.append(node.prettify())
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


IDLE_MINUTES = 90  # past the longest window the rules read (an hour, 10 minutes ago)
IDLE_CHECKS = ("15m", "45m", "80m")


@pytest.mark.parametrize("fleet", sorted(IDLE_FLEETS))
def test_alerts_that_divide_stay_quiet_and_finite_on_an_idle_fleet(fleet: str, tmp_path: Path) -> None:
    """Over an idle fleet (``fleet``) no alert whose rule divides fires at any time, and each of
    its ratios answers no sample rather than NaN (0/0) or ±Inf (x/0)."""
    dividing = [a for a in alerts.all_alerts() if divisions(a.expr)]
    assert {a.name for a in dividing} >= {"KVPoolLoadErrorsRising", "KVPoolStoreFull"}
    history = idle_history([a.expr for a in dividing], IDLE_FLEETS[fleet], IDLE_MINUTES)
    ratios = {f"{a.name} ratio {i}": d for a in dividing for i, d in enumerate(divisions(a.expr), 1)}
    test = {
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in history.items()],
        "alert_rule_test": [
            {"eval_time": time, "alertname": a.name, "exp_alerts": []}
            for a in dividing
            for time in IDLE_CHECKS
        ],
        "promql_expr_test": [
            {"expr": non_finite(ratio, name), "eval_time": time, "exp_samples": []}
            for name, ratio in ratios.items()
            for time in IDLE_CHECKS
        ],
    }
    path = tmp_path / "idle_alerts_test.yaml"
    rules = {"rule_files": [str(RULES_FILE)], "evaluation_interval": "1m", "tests": [test]}
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    result = subprocess.run(
        [promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
