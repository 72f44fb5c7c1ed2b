"""The ratio a benchmark judges a target on: drift between paired runs cancels."""

from __future__ import annotations

import pytest

from benchmarks.ttft import bracketed_ratios


def test_a_hit_is_held_to_the_recomputes_on_either_side() -> None:
    # The machine slows by 10% per run: a hit that costs what a recompute does reads 1.0x.
    recomputes = [10.0, 11.0, 12.0, 13.0]
    hits = [10.5, 11.5, 12.5]
    ratio = bracketed_ratios(hits, recomputes)
    assert (ratio.low, ratio.high, ratio.n) == (pytest.approx(1.0), pytest.approx(1.0), 3)


def test_pairing_by_index_reads_the_same_drift_as_a_cost() -> None:
    # The control: without the closing recompute the same runs read ~1.05x.
    recomputes = [10.0, 11.0, 12.0]
    hits = [10.5, 11.5, 12.5]
    assert bracketed_ratios(hits, recomputes).low > 1.04
