"""The ratio a benchmark judges a target on: drift between paired runs cancels.

Checked in a child interpreter: importing the ``benchmarks`` package quiets vLLM's and
Mooncake's logs for every engine this process would start later (tests read those logs).
"""

from __future__ import annotations

import json

from testing.child_processes import python_answer

#: A machine that slows by 10% per run; each hit costs what a recompute does at its time.
RECOMPUTES = [10.0, 11.0, 12.0, 13.0]
HITS = [10.5, 11.5, 12.5]


def _ratio(function: str, hits: list[float], recomputes: list[float]) -> dict[str, float]:
    """``function`` (``module.name``) of the runs, computed in a child interpreter."""
    module, name = function.rsplit(".", 1)
    code = (
        f"import json, sys; from {module} import {name}; "
        f"s = {name}(*json.loads(sys.argv[1])); "
        "print(json.dumps({'low': s.low, 'high': s.high, 'n': s.n}))"
    )
    return dict(python_answer(code, json.dumps([hits, recomputes])))


def test_a_hit_is_held_to_the_recomputes_on_either_side() -> None:
    # Each hit against the recomputes on either side of it reads 1.0x.
    ratio = _ratio("benchmarks.ttft.bracketed_ratios", HITS, RECOMPUTES)
    assert (round(ratio["low"], 9), round(ratio["high"], 9), ratio["n"]) == (1.0, 1.0, 3)


def test_pairing_by_index_reads_the_same_drift_as_a_cost() -> None:
    # The control: each hit paired with the recompute before it, the same runs read ~1.05x.
    assert _ratio("benchmarks.common.ratios", HITS, RECOMPUTES[:-1])["low"] > 1.04
