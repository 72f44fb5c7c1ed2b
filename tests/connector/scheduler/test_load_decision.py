"""The load decision with fake rates, and the rates it learns from what the scheduler sees.

Pure parts: ``decide`` over made-up rates (both outcomes, the margin, the floor, forced
modes, the probe), ``LoadRates`` over made-up observations and a fake clock, and the
worker stats payload as ``records_to_data`` writes it from real ``TransferRecord``s.
"""

from __future__ import annotations

import pytest

from kvpool.connector.contract import metric_names as m
from kvpool.connector.contract.settings import ConnectorSettings, SettingsError
from kvpool.connector.observability.records import TransferRecord
from kvpool.connector.observability.vllm_metrics import (
    PoolConnectorStats,
    decision_data,
    records_to_data,
    series_key,
    transfer_sample,
)
from kvpool.connector.scheduler.load_decision import (
    PROBE_EVERY,
    VERDICT_LABELS,
    Basis,
    LoadPolicy,
    Rates,
    decide,
)
from kvpool.connector.scheduler.load_rates import LoadRates, Throughput

MIB = 1 << 20
#: 100 MiB/s of load, 10k tokens/s of prefill, each on 10 observations.
RATES = Rates(load_bytes_per_s=100 * MIB, load_samples=10, prefill_tokens_per_s=10_000, prefill_samples=10)


def auto(hit_tokens: int, hit_bytes: int | None, rates: Rates = RATES, margin: float = 0.1, **kw: int):
    return decide(
        LoadPolicy.AUTO,
        hit_tokens=hit_tokens,
        hit_bytes=hit_bytes,
        rates=rates,
        margin=margin,
        min_samples=4,
        **kw,
    )


def test_a_hit_loads_when_loading_is_faster() -> None:
    verdict = auto(hit_tokens=1000, hit_bytes=MIB)  # 10 ms to load, 100 ms to recompute
    assert verdict.load and verdict.basis is Basis.ESTIMATE
    assert verdict.load_s == pytest.approx(0.01)
    assert verdict.recompute_s == pytest.approx(0.1)


def test_a_hit_recomputes_when_recomputing_is_faster() -> None:
    verdict = auto(hit_tokens=1000, hit_bytes=100 * MIB)  # 1 s to load, 0.1 s to recompute
    assert not verdict.load and verdict.basis is Basis.ESTIMATE
    assert verdict.load_s == pytest.approx(1.0)


def test_loading_must_be_faster_by_the_margin() -> None:
    # 95 ms to load, 100 ms to recompute: faster, but not by 10 %.
    hit_bytes = int(9.5 * MIB)
    assert not auto(hit_tokens=1000, hit_bytes=hit_bytes, margin=0.1).load
    assert auto(hit_tokens=1000, hit_bytes=hit_bytes, margin=0.05).load
    assert auto(hit_tokens=1000, hit_bytes=hit_bytes, margin=0.0).load


@pytest.mark.parametrize(
    "rates",
    [
        Rates(load_bytes_per_s=1.0, load_samples=3, prefill_tokens_per_s=1e9, prefill_samples=10),
        Rates(load_bytes_per_s=1.0, load_samples=10, prefill_tokens_per_s=1e9, prefill_samples=3),
        Rates(load_bytes_per_s=0.0, load_samples=10, prefill_tokens_per_s=1e9, prefill_samples=10),
        Rates(),
    ],
    ids=["few-loads", "few-prefills", "no-load-rate", "nothing"],
)
def test_below_the_floor_every_hit_loads(rates: Rates) -> None:
    """Rates that would recompute every hit are not trusted on too few observations."""
    verdict = auto(hit_tokens=1000, hit_bytes=100 * MIB, rates=rates)
    assert verdict.load and verdict.basis is Basis.FLOOR
    assert verdict.load_s is None and verdict.recompute_s is None


def test_a_hit_of_unknown_size_loads() -> None:
    verdict = auto(hit_tokens=1000, hit_bytes=None)
    assert verdict.load and verdict.basis is Basis.FLOOR


def test_forced_policies_ignore_the_rates() -> None:
    cheap_load = {"hit_tokens": 1000, "hit_bytes": 1, "rates": RATES, "margin": 0.0, "min_samples": 1}
    dear_load = {**cheap_load, "hit_bytes": 1 << 40}
    assert not decide(LoadPolicy.NEVER, **cheap_load).load  # type: ignore[arg-type]
    assert decide(LoadPolicy.ALWAYS, **dear_load).load  # type: ignore[arg-type]
    assert decide(LoadPolicy.NEVER, **cheap_load).basis is Basis.FORCED  # type: ignore[arg-type]


def test_a_long_run_of_recomputes_probes_the_link_once() -> None:
    assert not auto(hit_tokens=1000, hit_bytes=100 * MIB, recomputed_in_a_row=PROBE_EVERY - 1).load
    probe = auto(hit_tokens=1000, hit_bytes=100 * MIB, recomputed_in_a_row=PROBE_EVERY)
    assert probe.load and probe.basis is Basis.PROBE


def test_every_verdict_decide_reaches_is_one_exported_at_zero_from_the_start() -> None:
    """``VERDICT_LABELS`` (the load decisions exported at 0 before the first) are exactly the
    verdicts ``decide`` reaches."""
    reached = {
        decide(
            policy,
            hit_tokens=1000,
            hit_bytes=hit_bytes,
            rates=rates,
            margin=0.1,
            min_samples=4,
            recomputed_in_a_row=row,
        ).labels
        for policy in LoadPolicy
        for hit_bytes in (None, 1, 100 * MIB)
        for rates in (Rates(), RATES)
        for row in (0, PROBE_EVERY)
    }
    assert reached == set(VERDICT_LABELS) and len(VERDICT_LABELS) == len(reached)


def test_load_policy_is_validated_by_name() -> None:
    base = {"master_server_address": "127.0.0.1:50051"}
    assert ConnectorSettings.parse(base).load_policy == "auto"
    assert ConnectorSettings.parse({**base, "load_policy": "never"}).load_policy == "never"
    with pytest.raises(SettingsError) as bad:
        ConnectorSettings.parse({**base, "load_policy": "sometimes", "load_margin": -1})
    assert set(bad.value.problems) == {"load_policy", "load_margin"}
    assert "'auto', 'always' or 'never'" in bad.value.problems["load_policy"]
    assert "greater than or equal to 0" in bad.value.problems["load_margin"]
    with pytest.raises(SettingsError) as floor:
        ConnectorSettings.parse({**base, "load_decision_min_samples": 0})
    assert "greater than or equal to 1" in floor.value.problems["load_decision_min_samples"]


# --- the rates ------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_throughput_follows_the_newer_observations() -> None:
    rate = Throughput(half_life=1)
    rate.observe(100.0, 1.0)
    assert rate.rate == 100.0 and rate.samples == 1
    rate.observe(10.0, 1.0)  # the first now weighs half
    assert rate.rate == pytest.approx((50.0 + 10.0) / 1.5)
    rate.observe(30.0, 0.0)  # an amount whose time another sample holds: no new sample
    assert rate.samples == 2


def test_prefill_rate_counts_prefilling_steps_first_in_first_out() -> None:
    clock = FakeClock()
    rates = LoadRates(min_prefill_tokens=32, clock=clock)
    rates.step_planned(tokens=1000, requests=1)  # the first prefill: the engine's warm-up
    clock.now += 30.0
    rates.step_reported()
    assert rates.prefill.samples == 0
    rates.step_planned(tokens=1000, requests=1)  # a prefill
    clock.now += 0.5
    rates.step_planned(tokens=8, requests=8)  # decodes only, planned before the first's output
    clock.now += 0.5
    rates.step_reported()  # the first: 1000 tokens in 1 s
    clock.now += 1.0
    rates.step_reported()  # the decodes: not a prefill sample
    rates.step_reported()  # nothing planned: ignored
    assert rates.prefill.samples == 1
    assert rates.prefill.rate == pytest.approx(1000.0)
    # Two steps whose sizes say nothing of a cost per token (the larger was faster): the
    # prefilling steps' tokens over their seconds.
    assert rates.rates("tcp") == Rates(0.0, 0, pytest.approx(1000.0), 1)


def test_the_prefill_rate_is_the_cost_of_one_more_token() -> None:
    """Steps of 0.1 s plus 1 ms a token: 1000 tokens/s (and 0.1 s of overhead), where tokens over
    seconds of the prefills alone would say 1000/1.1 and 300/0.4."""
    clock = FakeClock()
    rates = LoadRates(min_prefill_tokens=32, clock=clock)
    for tokens, requests in [(600, 1), (1000, 1), (4, 4), (1000, 2), (8, 8), (300, 1), (2, 2)]:
        rates.step_planned(tokens, requests)
        clock.now += 0.1 + tokens / 1000
        rates.step_reported()
    got = rates.rates("tcp")
    assert got.prefill_samples == 3  # the first prefill warmed the engine up; decodes are none
    assert got.prefill_tokens_per_s == pytest.approx(1000.0)
    assert rates.step_cost.fit(32) == (pytest.approx(0.1), pytest.approx(0.001))


def _load(
    bytes_per_group: tuple[int, ...],
    blocks: tuple[int, ...],
    seconds: tuple[float, ...],
    rank: int | None = None,
    failed: int = 0,
):
    kinds = ("full", "sliding_window")[: len(blocks)]
    return TransferRecord(
        operation=m.LOAD,
        group_kinds=kinds,
        blocks=blocks,
        masked=tuple(0 for _ in blocks),
        bytes=bytes_per_group,
        failures={"rpc_failed": failed} if failed else {},
        seconds=sum(seconds),
        group_failures=tuple({"rpc_failed": failed} if failed and g == 0 else {} for g in range(len(blocks))),
        group_seconds=seconds,
        group_attempted=tuple(True for _ in blocks),
        rank=rank,
    )


def test_load_rate_and_block_sizes_come_from_the_workers_stats() -> None:
    """Two ranks' records, merged as vLLM merges workers' stats: every rank's bytes over rank 0's
    seconds; block sizes over every rank's bytes and rank 0's blocks."""
    rank0 = records_to_data([], [_load((8 * MIB, 2 * MIB), (8, 2), (0.1, 0.1), rank=0)])
    rank1 = records_to_data([], [_load((8 * MIB, 2 * MIB), (8, 2), (0.3, 0.3), rank=1)])
    merged = PoolConnectorStats(data=rank0).aggregate(PoolConnectorStats(data=rank1))
    sample = transfer_sample(merged.data)
    assert sample.load_bytes == 20 * MIB
    assert sample.load_seconds == pytest.approx(0.2)  # rank 0's groups, one after the other

    rates = LoadRates()
    rates.observe_transfers(sample, "tcp")
    assert rates.rates("tcp").load_bytes_per_s == pytest.approx(100 * MIB)
    assert rates.rates("tcp").load_samples == 1
    assert rates.rates("rdma").load_samples == 0  # per transport
    assert rates.block_bytes(0) == 2 * MIB  # 16 MiB over 8 blocks
    assert rates.block_bytes(1) == 2 * MIB
    # A hit needing blocks 0..9 of group 0 and 8..9 of group 1, past a 4-block (64-token) local hit.
    assert rates.hit_bytes(((*range(10),), (8, 9)), (16, 16), 64) == (6 + 2) * 2 * MIB
    assert rates.hit_bytes(((*range(10),), (8, 9)), (16, 16), 160) == 0
    assert LoadRates().hit_bytes(((1, 2),), (16,), 0) is None  # no block moved yet: unknown


def test_decisions_and_rates_are_exported_under_their_names() -> None:
    data = decision_data({("recompute", "estimate"): 2, ("load", "floor"): 1}, 640, {"tcp": 5e8}, 2e4)
    counters, gauges = data["counters"], data["gauges"]
    assert counters[series_key(m.LOAD_DECISIONS, decision="recompute", basis="estimate")] == 2
    assert counters[series_key(m.LOAD_DECISIONS, decision="load", basis="floor")] == 1
    assert counters[series_key(m.LOAD_SKIPPED_TOKENS)] == 640
    assert gauges[series_key(m.LOAD_RATE, transport="tcp")] == 5e8
    assert gauges[series_key(m.PREFILL_RATE)] == 2e4
    assert decision_data({}, 0, None, None) == {"counters": {}, "histograms": {}, "gauges": {}}


def test_a_failed_load_teaches_the_load_rate_nothing() -> None:
    """A load that failed (here: seconds waiting on a dead master, one group's bytes) measures
    the fault, not the link: the rate learns from clean loads only, and the load still counts
    in the exported bytes and latency."""
    clean = _load((8 * MIB, 2 * MIB), (8, 2), (0.05, 0.05), rank=0)
    failed = _load((0, 2 * MIB), (8, 2), (5.0, 0.05), rank=0, failed=8)
    data = records_to_data([], [clean, failed])
    sample = transfer_sample(data)
    assert sample.load_bytes == 10 * MIB
    assert sample.load_seconds == pytest.approx(0.1)
    latencies = data["histograms"][series_key(m.OPERATION_SECONDS, operation=m.LOAD, group_kind="full")]
    assert latencies == [0.05, 5.0]

    only_failed = transfer_sample(records_to_data([], [failed]))
    rates = LoadRates()
    rates.observe_transfers(only_failed, "tcp")
    assert rates.rates("tcp").load_samples == 0
