"""Panel queries give the right numbers on series of known values, in Prometheus' own engine.

``promtool test rules`` evaluates each query (as Grafana sends it: variables "All", a 5-minute
rate interval) over a synthetic history, and compares every series it returns with the one
expected: a query that sums what it should keep apart, or keeps apart what it should sum,
fails here. On an idle fleet (``tests.dashboards.idle``) no query may answer NaN or ±Inf.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from dashboards import connector_board, external, generate, operator_board, pool_board
from kvpool.connector.contract import metric_names as m
from kvpool.operator import metric_names as o
from tests.dashboards.idle import IDLE_FLEETS, idle_history, non_finite
from tests.dashboards.queries import panel_queries, substitute
from tests.dashboards.test_alerts import promtool, series

EVAL_TIME = "10m"  # every history below moves steadily for 10 minutes, one sample a minute


def per_second(rate: float) -> str:
    """A counter's promtool values growing by ``rate`` per second, sampled every minute."""
    return f"0+{rate * 60:g}x10"


@dataclass(frozen=True)
class Case:
    """A panel's query (``ref``), its input series, and each series it must return."""

    uid: str
    panel: str
    ref: str
    history: dict[str, str]
    expected: dict[str, float]  # result labels ({a="b"}) -> value


def _labels(**labels: str) -> str:
    return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def _query(case: Case) -> str:
    found = [
        q
        for q in panel_queries(case.uid, generate.dashboards()[case.uid])
        if q.panel == case.panel and q.ref == case.ref
    ]
    assert len(found) == 1, f"no query {case.ref} of a panel {case.panel!r} on {case.uid}"
    return substitute(found[0].expr)


ENGINE = {"namespace": "team-a", "pool": "pool-a", "engine": "0"}
# Two models, each with its own group 0 of the same kind: different KV-cache groups.
SMALL = {**ENGINE, "model_name": "small", "group": "0", "group_kind": "full"}
LARGE = {**ENGINE, "model_name": "large", "group": "0", "group_kind": "full"}
GROUP_OF = {"model_name", "group", "group_kind"}


def _per_model_group(spec: m.MetricSpec, **extra: str) -> tuple[dict[str, str], dict[str, float]]:
    """Two models' group 0 moving at 1 and 3 per second, and the two lines a panel must show."""
    history = {
        series(spec.exported, **SMALL, **extra): per_second(1),
        series(spec.exported, **LARGE, **extra): per_second(3),
    }
    shown = GROUP_OF | set(extra)
    expected = {
        _labels(**{k: v for k, v in {**SMALL, **extra}.items() if k in shown}): 1.0,
        _labels(**{k: v for k, v in {**LARGE, **extra}.items() if k in shown}): 3.0,
    }
    return history, expected


# Two replicas of one consumer: each server numbers its engines from 0 (its scrape target,
# ``instance``, tells them apart).
REPLICAS = [{**ENGINE, "model_name": "small", "instance": f"10.0.0.{i}:8000"} for i in (1, 2)]


def _per_replica(
    spec: m.MetricSpec, values: tuple[str, str], **extra: str
) -> tuple[dict[str, str], dict[str, float]]:
    """A gauge (or a counter's total) of each replica's engine 0, and the two lines a panel must show."""
    history = {series(spec.exported, **r, **extra): v for r, v in zip(REPLICAS, values)}
    shown = {"model_name", "engine", "instance", *extra}
    expected = {
        _labels(**{k: v for k, v in {**r, **extra}.items() if k in shown}): float(v.split("+")[0])
        for r, v in zip(REPLICAS, values)
    }
    return history, expected


def _by_source() -> tuple[dict[str, str], dict[str, float], dict[str, float]]:
    """One model's prompt tokens: 6/s prefilled, 1/s from its own cache, 3/s loaded from the pool;
    the history, then the tokens per second and the shares the panels must show."""
    rates = {external.PROMPT_COMPUTED: 6, external.PROMPT_LOCAL_CACHE: 1, external.PROMPT_LOADED: 3}
    counter = external.total(external.VLLM_PROMPT_TOKENS_BY_SOURCE)
    labels = {**ENGINE, "model_name": "small"}
    history = {series(counter, **labels, source=source): per_second(r) for source, r in rates.items()}
    tokens = {_labels(model_name="small", source=source): float(r) for source, r in rates.items()}
    skipped = (external.PROMPT_LOCAL_CACHE, external.PROMPT_LOADED)
    shares = {_labels(model_name="small", source=source): rates[source] / 10 for source in skipped}
    return history, tokens, shares


def _no_master_serves() -> tuple[dict[str, str], dict[str, float]]:
    """Two HA masters of a pool, up, neither holding store memory (no leader serves): the
    pool's "serving" line reads 0 (it is there, at zero), not nothing."""
    pool = {"namespace": "team-a", "pool": "pool-a"}
    history = {
        series(external.MASTER_CAPACITY, **pool, instance=f"10.0.0.{i}:9003"): "0+0x10" for i in (1, 2)
    }
    return history, {_labels(**pool): 0.0}


def _group_hit_rate() -> tuple[dict[str, str], dict[str, float]]:
    """Two models' group 0 hitting 1 and 3 tokens a second of the 2 and 4 each looks up: the
    per-group share divides by its own model's lookups (many-to-one on the model)."""
    history, _ = _per_model_group(m.GROUP_HIT_TOKENS)
    history[series(m.LOOKUP_QUERY_TOKENS.exported, **ENGINE, model_name="small")] = per_second(2)
    history[series(m.LOOKUP_QUERY_TOKENS.exported, **ENGINE, model_name="large")] = per_second(4)
    group = {"group": "0", "group_kind": "full"}
    return history, {
        _labels(model_name="small", **group): 0.5,
        _labels(model_name="large", **group): 0.75,
    }


def _failed_share() -> tuple[dict[str, str], dict[str, float]]:
    """Loads: 1 key a second missing, 3 moved (a quarter failed); saves: 1 a second in flight
    (not a failure), 1 moved (none failed)."""
    small = {**ENGINE, "model_name": "small", "group": "0", "group_kind": "full"}
    failures, moved = m.FAILURES.exported, m.TRANSFER_KEYS.exported
    history = {
        series(failures, **small, operation=m.LOAD, reason="missing"): per_second(1),
        series(moved, **small, operation=m.LOAD): per_second(3),
        series(failures, **small, operation=m.SAVE, reason="in_flight"): per_second(1),
        series(moved, **small, operation=m.SAVE): per_second(1),
    }
    return history, {
        _labels(model_name="small", operation=m.LOAD): 0.25,
        _labels(model_name="small", operation=m.SAVE): 0.0,
    }


def _reconcile_p50() -> tuple[dict[str, str], dict[str, float]]:
    """Every resync pass takes under 0.1 s (one a second): its median reads 0.05 s, the middle
    of the first bucket."""
    bucket = o.RECONCILE_DURATION.exported + "_bucket"
    history = {series(bucket, trigger="resync", le=le): per_second(1) for le in ("0.1", "+Inf")}
    return history, {_labels(trigger="resync"): 0.05}


def _quota_use() -> tuple[dict[str, str], dict[str, float]]:
    """A grant charged a quarter of its quota, one without quota (no line: not NaN, not Inf)."""
    pool = {"namespace": "team-a", "pool": "pool-a"}
    history = {
        series(o.GRANT_USED_BYTES.exported, **pool, grant="g1"): "250x10",
        series(o.GRANT_QUOTA_BYTES.exported, **pool, grant="g1"): "1000x10",
        series(o.GRANT_USED_BYTES.exported, **pool, grant="g2"): "250x10",
        series(o.GRANT_QUOTA_BYTES.exported, **pool, grant="g2"): "0x10",
    }
    return history, {_labels(**pool, grant="g1"): 0.25}


def cases() -> list[Case]:
    board = connector_board.UID
    present = "Blocks present in the pool, and blocks the hit uses, per group"
    load = {"operation": m.LOAD}
    history, tokens, shares = _by_source()
    return [
        Case(pool_board.UID, "Masters up and serving", "B", *_no_master_serves()),
        Case(pool_board.UID, "Use of quota per grant", "A", *_quota_use()),
        Case(operator_board.UID, "Reconcile duration p50 and p99", "A", *_reconcile_p50()),
        Case(board, "Hit rate per KV-cache group, and the HMA hit", "A", *_group_hit_rate()),
        Case(board, "Share of keys that failed", "A", *_failed_share()),
        Case(board, "Prompt tokens by where their KV came from", "A", history, tokens),
        Case(board, "Share of prompt tokens whose prefill was skipped", "A", history, shares),
        Case(board, present, "A", *_per_model_group(m.PRESENT_BLOCKS)),
        Case(board, present, "B", *_per_model_group(m.HIT_BLOCKS)),
        Case(
            board,
            "Masked blocks per group, on load and save",
            "A",
            *_per_model_group(m.MASKED_BLOCKS, **load),
        ),
        Case(board, "Blocks moved per group", "A", *_per_model_group(m.TRANSFER_BLOCKS, **load)),
        Case(
            board,
            "Rates the decision uses",
            "A",
            *_per_replica(m.LOAD_RATE, ("1000+0x10", "250+0x10"), transport="tcp"),
        ),
        Case(board, "Rates the decision uses", "B", *_per_replica(m.PREFILL_RATE, ("800+0x10", "40+0x10"))),
        Case(
            board,
            "Engines out of the pool: declared layout differs",
            "A",
            *_per_replica(m.LAYOUT_MISMATCHES, ("1+0x10", "1+0x10"), field="dtype"),
        ),
    ]


def test_panel_queries_give_the_expected_series(tmp_path: Path) -> None:
    tests = [
        {
            "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in case.history.items()],
            "promql_expr_test": [
                {
                    "expr": _query(case),
                    "eval_time": EVAL_TIME,
                    "exp_samples": [
                        {"labels": labels, "value": value} for labels, value in case.expected.items()
                    ],
                }
            ],
        }
        for case in cases()
    ]
    path = tmp_path / "panels_test.yaml"
    path.write_text(
        yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": tests}, sort_keys=False)
    )
    result = subprocess.run(
        [promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("fleet", sorted(IDLE_FLEETS))
def test_no_panel_query_reads_nan_or_inf_on_an_idle_fleet(fleet: str, tmp_path: Path) -> None:
    """Every panel query, over every series the panels read held still (``fleet``): no data,
    or 0 where 0 is the truth; never NaN (0/0, a quantile of no observation) nor ±Inf."""
    queries = [q for uid, model in generate.dashboards().items() for q in panel_queries(uid, model)]
    exprs = {str(q): substitute(q.expr) for q in queries}
    history = idle_history(exprs.values(), IDLE_FLEETS[fleet], minutes=20)
    test = {
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in history.items()],
        "promql_expr_test": [
            {"expr": non_finite(expr, name), "eval_time": EVAL_TIME, "exp_samples": []}
            for name, expr in exprs.items()
        ],
    }
    path = tmp_path / "idle_panels_test.yaml"
    path.write_text(
        yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": [test]}, sort_keys=False)
    )
    result = subprocess.run(
        [promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
