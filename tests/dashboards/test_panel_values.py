"""Panel queries give the right numbers on series of known values, in Prometheus' own engine.

``promtool test rules`` evaluates each query (as Grafana sends it: variables "All", a 5-minute
rate interval) over a synthetic history, and compares every series it returns with the one
expected: a query that sums what it should keep apart, or keeps apart what it should sum,
fails here.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from dashboards import connector_board, external, generate, pool_board
from kvpool.connector.contract import metric_names as m
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


def cases() -> list[Case]:
    board = connector_board.UID
    present = "Blocks present in the pool, and blocks the hit uses, per group"
    load = {"operation": m.LOAD}
    history, tokens, shares = _by_source()
    return [
        Case(pool_board.UID, "Masters up and serving", "B", *_no_master_serves()),
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
