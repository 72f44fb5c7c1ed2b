"""The chaos judgement over hand-made histories: each rule catches what it is for, and only that."""

from __future__ import annotations

import math
from pathlib import Path

from testing import chaos_history as ch
from testing.chaos_history import FaultRecord, History, MetricsSample, ProcSample, RequestRecord, prompt_key
from testing.chaos_judgement import (
    FINISHED_LENGTH,
    HIT_TOKENS,
    QUERY_TOKENS,
    by_kind,
    failure_counts,
    fates,
    hit_rate_timeline,
    leaks,
    loaded_blocks,
    metrics_disagreements,
    recovery_seconds,
    wrong_answers,
)

PROMPT_A, PROMPT_B = [5, 6, 7], [8, 9]
REFERENCES = {prompt_key(PROMPT_A): [1, 2, 3, 4], prompt_key(PROMPT_B): [9, 9, 9, 9]}


def request(
    rid: int,
    outcome: str = ch.COMPLETED,
    *,
    tokens: list[int] | None = None,
    prompt: list[int] | None = None,
    server: int = 0,
    sent: float = 0.0,
    ended: float | None = 1.0,
) -> RequestRecord:
    return RequestRecord(
        rid,
        server,
        0,
        0,
        prompt or PROMPT_A,
        4,
        sent,
        None,
        ended,
        [1, 2, 3, 4] if tokens is None else tokens,
        outcome,
    )


def test_a_completed_answer_must_equal_its_reference_and_a_hung_up_one_be_its_prefix() -> None:
    right = request(1)
    wrong = request(2, tokens=[1, 2, 3, 5])
    other_prompt = request(3, prompt=PROMPT_B, tokens=[9, 9, 9, 9])
    hung_up_prefix = request(4, ch.DISCONNECTED, tokens=[1, 2])
    hung_up_wrong = request(5, ch.DISCONNECTED, tokens=[2])
    hung_up_early = request(6, ch.DISCONNECTED, tokens=[])
    unreferenced = request(7, prompt=[1])
    refused = request(8, ch.REFUSED, tokens=[])
    everything = [
        right,
        wrong,
        other_prompt,
        hung_up_prefix,
        hung_up_wrong,
        hung_up_early,
        unreferenced,
        refused,
    ]
    assert wrong_answers(everything, REFERENCES) == [wrong, hung_up_wrong, unreferenced]


def test_fates_count_hangs_refusals_and_restarts_apart() -> None:
    restart = FaultRecord("server_restarted", target=1, planned_at=10.0, started=10.0, ended=40.0)
    ok = request(1, sent=0.0, ended=5.0)
    slow = request(2, sent=0.0, ended=95.0)  # completed, but past the bound
    never = request(3, sent=0.0, ended=None)
    timed_out = request(4, ch.TIMED_OUT, sent=0.0, ended=30.0)
    cut = request(5, ch.FAILED, server=1, sent=8.0, ended=10.5)  # in flight at the kill
    refused_down = request(6, ch.REFUSED, server=1, sent=20.0, ended=20.01)
    refused_late = request(7, ch.REFUSED, server=1, sent=41.0, ended=41.1)  # within the slack
    refused = request(8, ch.REFUSED, server=0, sent=20.0, ended=20.1)  # the other server
    broken = request(9, ch.FAILED, server=1, sent=60.0, ended=61.0)  # no restart explains it
    hung_up = request(10, ch.DISCONNECTED, sent=1.0, ended=1.5)
    verdict = fates(
        [ok, slow, never, timed_out, cut, refused_down, refused_late, refused, broken, hung_up],
        [restart],
        bound_s=90.0,
    )
    assert verdict.completed == [ok]
    assert verdict.hung == [slow, never, timed_out]
    assert verdict.refused_in_restart == [cut, refused_down, refused_late]
    assert verdict.refused == [refused]
    assert verdict.failed == [broken]
    assert verdict.disconnected == [hung_up]


def test_a_request_cut_while_its_server_was_frozen_counts_with_the_restarts() -> None:
    freeze = FaultRecord("server_frozen", target=0, planned_at=50.0, started=50.0, ended=56.0)
    cut = request(1, ch.FAILED, server=0, sent=50.4, ended=56.01)  # reset when it was continued
    other = request(2, ch.FAILED, server=1, sent=50.4, ended=56.01)  # the other server: no excuse
    late = request(3, ch.FAILED, server=0, sent=60.0, ended=60.5)
    verdict = fates([cut, other, late], [freeze], bound_s=90.0)
    assert verdict.refused_in_restart == [cut]
    assert verdict.failed == [other, late]


def metrics(
    t: float, server: int, generation: int, hits: float, queries: float, **more: float
) -> MetricsSample:
    return MetricsSample(t, server, generation, {HIT_TOKENS: hits, QUERY_TOKENS: queries, **more})


def test_the_hit_rate_sums_increments_of_every_server_generation() -> None:
    samples = [
        metrics(1, 0, 0, 0, 0),
        metrics(1, 1, 0, 0, 0),
        metrics(9, 0, 0, 50, 100),
        metrics(9, 1, 0, 30, 100),
        # server 1 restarted: its counters start again from nought, not a negative increment
        metrics(12, 1, 1, 0, 0),
        metrics(19, 1, 1, 10, 100),
        metrics(19, 0, 0, 50, 200),
        metrics(29, 0, 0, 50, 200),
    ]
    timeline = hit_rate_timeline(samples, window_s=10.0)
    assert timeline == [(10.0, 0.4), (20.0, 0.05), (30.0, None)]


def test_loaded_blocks_sum_every_group_s_loads_in_the_window_and_nothing_else() -> None:
    load = 'vllm:kvpool_transfer_blocks_total{group="%d",group_kind="full",operation="load"}'
    save = 'vllm:kvpool_transfer_blocks_total{group="0",group_kind="full",operation="save"}'
    samples = [
        MetricsSample(0.0, 0, 0, {load % 0: 5.0, load % 1: 5.0, save: 9.0}),
        MetricsSample(10.0, 0, 0, {load % 0: 7.0, load % 1: 8.0, save: 19.0}),
        MetricsSample(20.0, 0, 0, {load % 0: 9.0, load % 1: 8.0, save: 29.0}),
        MetricsSample(12.0, 1, 1, {load % 0: 100.0}),  # a restarted server counts from its own start
        MetricsSample(18.0, 1, 1, {load % 0: 104.0}),
    ]
    assert loaded_blocks(samples, 5.0, 18.0) == 5.0 + 4.0
    assert loaded_blocks(samples, 19.0, 30.0) == 2.0
    assert loaded_blocks(samples, 30.0, 40.0) == 0.0


def fault(kind: str, started: float, ended: float, target: int = 0) -> FaultRecord:
    return FaultRecord(kind, target, started, started, ended)


def test_recovery_is_the_time_after_the_fault_until_the_rate_is_back() -> None:
    timeline: list[tuple[float, float | None]] = [
        (10.0, 0.8),
        (20.0, 0.8),
        (30.0, 0.0),  # the fault
        (40.0, None),  # nothing looked up
        (50.0, 0.3),  # below half the level before
        (60.0, 0.5),  # back
    ]
    assert recovery_seconds(fault("store_restarted", 21.0, 32.0), timeline, 10.0) == 28.0
    assert recovery_seconds(fault("store_restarted", 21.0, 32.0), timeline[:5], 10.0) == math.inf
    assert recovery_seconds(fault("store_restarted", 1.0, 5.0), timeline, 10.0) is None  # no level before
    steady: list[tuple[float, float | None]] = [(10.0, 0.8), (20.0, 0.8), (30.0, 0.8)]
    assert recovery_seconds(fault("store_frozen", 21.0, 22.0), steady, 10.0) == 8.0  # within its window


def test_recovery_waits_for_the_faults_that_began_before_the_rate_came_back() -> None:
    timeline: list[tuple[float, float | None]] = [
        (10.0, 0.8),
        (20.0, 0.8),
        (30.0, 0.1),
        (40.0, 0.1),
        (50.0, 0.1),
        (60.0, 0.1),
        (70.0, 0.6),
    ]
    frozen = fault("store_frozen", 21.0, 25.0)
    restart = fault("server_restarted", 24.0, 55.0)  # began while the freeze held
    later = fault("pool_full", 35.0, 40.0)  # began after the freeze, before the rate came back
    elsewhere = fault("etcd_member_restarted", 80.0, 85.0)  # after the rate came back: no matter
    others = [frozen, restart, later, elsewhere]
    assert recovery_seconds(frozen, timeline, 10.0) == 45.0  # alone: from its own end
    assert recovery_seconds(frozen, timeline, 10.0, others=others) == 15.0  # from the restart's end
    assert recovery_seconds(later, timeline, 10.0, others=others) == 15.0
    never_ends = fault("server_restarted", 24.0, 0.0)
    never_ends.ended = None
    assert recovery_seconds(frozen, timeline, 10.0, others=[never_ends]) == math.inf


def procs(server: int, generation: int, start: float, rss: list[int], threads: int = 50) -> list[ProcSample]:
    return [ProcSample(start + 10 * i, server, generation, r << 20, threads, 100) for i, r in enumerate(rss)]


def test_a_process_that_grows_after_warm_up_leaks_and_a_restart_starts_anew() -> None:
    flat = procs(0, 0, 0.0, [900, 1000, 1000, 1010, 1000, 1020, 1010, 1000, 1015])
    growing = procs(1, 0, 0.0, [900, 1000, 1100, 1300, 1500, 1700, 1900, 2100, 2300])
    restarted = procs(1, 1, 200.0, [1000] * 9)  # a new generation, judged on its own
    assert leaks(flat + restarted, warmup_s=15.0) == []
    assert leaks(growing, warmup_s=15.0) == ["server 1 generation 0: RSS 1300 -> 2100 MiB"]
    threads = procs(0, 0, 0.0, [1000] * 9, threads=50) + [
        ProcSample(100 + 10 * i, 0, 0, 1000 << 20, 90, 100) for i in range(3)
    ]
    assert leaks(threads, warmup_s=15.0) == ["server 0 generation 0: threads 50 -> 90"]


def test_metrics_must_count_the_completed_requests_and_the_outages() -> None:
    failures = 'vllm:kvpool_failures_total{reason="timeout"}'
    in_flight = 'vllm:kvpool_failures_total{operation="save",reason="in_flight"}'
    history = History(
        requests=[
            request(1, sent=5.0, ended=6.0),
            request(2, sent=7.0, ended=8.0),
            request(3, ch.REFUSED, sent=9.0),
        ],
        faults=[fault("store_frozen", 5.0, 7.0)],
        metrics=[
            MetricsSample(1.0, 0, 0, {FINISHED_LENGTH: 4.0}),
            MetricsSample(20.0, 0, 0, {FINISHED_LENGTH: 6.0, failures: 3.0, in_flight: 1.0}),
        ],
    )
    assert metrics_disagreements(history, final_generations={0: 0}) == []
    assert failure_counts(history.metrics) == {"timeout": 3.0, "in_flight": 1.0}
    # A client that hung up after its last token was made: the server may count it finished.
    history.requests.append(request(4, ch.DISCONNECTED, sent=10.0, ended=11.0))
    history.metrics[-1].series[FINISHED_LENGTH] = 7.0
    assert metrics_disagreements(history, final_generations={0: 0}) == []
    history.requests.pop()
    # One the server finished just before the first scrape, whose client read it just after.
    history.requests.append(request(5, sent=0.5, ended=1.2))
    assert metrics_disagreements(history, final_generations={0: 0}) == []
    history.requests.pop()
    history.metrics[-1].series[FINISHED_LENGTH] = 5.0
    history.metrics[-1].series[failures] = 0.0
    history.metrics[-1].series[in_flight] = 0.0
    # Every reason's series exists from the start: one at 0 counted nothing, the catch-all too.
    history.metrics[-1].series['vllm:kvpool_failures_total{reason="other_error"}'] = 0.0
    history.metrics[-1].series['vllm:kvpool_failures_total{reason="gremlins"}'] = 0.0
    assert metrics_disagreements(history, final_generations={0: 0, 1: 0}) == [
        "server 0 generation 0: 1 requests finished on /metrics, 2 completed in the history "
        "(2 sent after its first scrape, 0 hung up)",
        "server 1 generation 0: never scraped",
        "1 pool outages under traffic, no failure on /metrics",
    ]
    history.metrics[-1].series['vllm:kvpool_failures_total{reason="gremlins"}'] = 2.0
    assert metrics_disagreements(history, final_generations={0: 0})[1:] == [
        "unknown failure reasons on /metrics: ['gremlins']"
    ]


def test_each_kind_counts_the_requests_sent_while_it_held() -> None:
    frozen = fault("store_frozen", 10.0, 20.0)
    restart = fault("server_restarted", 50.0, 80.0, target=1)
    hung = request(1, sent=15.0, ended=None)
    wrong = request(2, tokens=[0], sent=25.0, ended=26.0)  # within a window after the thaw
    refused = request(3, ch.REFUSED, server=1, sent=60.0, ended=60.1)
    calm = request(4, tokens=[0], sent=40.0, ended=41.0)  # wrong, but no fault explains it
    history = History(requests=[hung, wrong, refused, calm], faults=[frozen, restart])
    verdict = fates(history.requests, history.faults, bound_s=90.0)
    timeline: list[tuple[float, float | None]] = [(10.0, 0.5), (20.0, 0.0), (30.0, 0.5), (90.0, 0.5)]
    rows = {row.kind: row for row in by_kind(history, verdict, [wrong, calm], timeline, 10.0)}
    assert (rows["store_frozen"].count, rows["store_frozen"].hung, rows["store_frozen"].wrong) == (1, 1, 1)
    assert rows["store_frozen"].recoveries == [10.0]
    assert (rows["server_restarted"].refused, rows["server_restarted"].wrong) == (1, 0)
    assert rows["server_restarted"].recovery_max == 10.0


def test_a_history_reads_back_as_written(tmp_path: Path) -> None:
    history = History(
        requests=[request(1), request(2, ch.DISCONNECTED, tokens=[1])],
        faults=[fault("leader_killed", 3.0, 9.0)],
        procs=procs(0, 0, 0.0, [1, 2]),
        metrics=[metrics(1.0, 0, 0, 1, 2)],
    )
    path = tmp_path / "history.jsonl"
    ch.write(path, history.records())
    assert ch.read(path) == history
