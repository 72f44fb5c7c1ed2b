"""Tensor-parallel ranks: counters once per request and group, bytes physical; the policies TP needs.

Every rank of an engine moves the same blocks of a request (each its share of the KV
heads, under its own keys): rank 0 counts the blocks and latencies, every rank adds its
bytes, the keys it moved and those that failed, and what vLLM recomputes after failed
loads (the union over ranks) is counted once by the scheduler, as is each transfer's size
(every rank's bytes of it, joined by the scheduler). The real-engine check is
in ``test_tensor_parallel.py``.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.config.kv_transfer import KVTransferConfig

from kvpool.connector.connector import recompute_failed_loads, record_recovery
from kvpool.connector.contract import metric_names as m
from kvpool.connector.observability.records import StatsCollector, TransferRecord
from kvpool.connector.observability.vllm_metrics import (
    RANK_BYTES,
    PoolConnectorStats,
    PoolPromMetrics,
    TransferSizes,
    parse_key,
    records_to_data,
)

KINDS = ("sliding_window", "full")


def load_on_rank(*, missing: int = 0) -> TransferRecord:
    return TransferRecord(
        operation=m.LOAD,
        group_kinds=KINDS,
        blocks=(2, 8 - missing),
        masked=(7, 0),
        bytes=(2 * 512, (8 - missing) * 512),
        failures={"missing": missing} if missing else {},
        seconds=0.02,
        group_failures=({}, {"missing": missing} if missing else {}),
        group_seconds=(0.005, 0.015),
        group_attempted=(True, True),
        recomputed=bool(missing),
    )


def stamped(rank: int, record: TransferRecord) -> TransferRecord:
    stats = StatsCollector(group_kinds=KINDS, rank=rank)
    stats.record_transfer(record)
    return stats.drain()[1][0]


def test_two_ranks_count_blocks_once_and_bytes_twice() -> None:
    rank0 = PoolConnectorStats(data=records_to_data([], [stamped(0, load_on_rank())]))
    rank1 = PoolConnectorStats(data=records_to_data([], [stamped(1, load_on_rank(missing=1))]))
    total = rank0.aggregate(rank1)
    assert total.counter(m.TRANSFER_BLOCKS) == 10  # one rank's blocks
    assert total.counter(m.MASKED_BLOCKS) == 7
    assert total.counter(m.TRANSFER_BYTES) == 10 * 512 + 9 * 512  # both ranks' bytes
    assert total.counter(m.TRANSFER_KEYS) == 10 + 9  # both ranks' keys
    assert total.counter(m.FAILURES) == 1  # rank 1's missing key
    # The workers' view of recomputation is partial: the scheduler counts it.
    assert total.counter(m.RECOMPUTED_REQUESTS) == 0
    assert len(total.data["histograms"]) == len(rank0.data["histograms"])  # rank 0's latencies only


def worker_payload(*records: TransferRecord) -> PoolConnectorStats:
    """One worker's stats for a step (its records stamped with their rank)."""
    return PoolConnectorStats(data=records_to_data([], list(records)))


def exported(*steps: PoolConnectorStats) -> dict[str, float]:
    """What /metrics shows of the transfers after ``steps`` (each: the step's workers' stats,
    aggregated as vLLM's KVOutputAggregator does), passed through the scheduler as the
    connector does: its ``TransferSizes`` takes the ranks' shares out of the workers' stats,
    and its own stats carry the joined observations."""
    sizes = TransferSizes(ranks=2)
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = PoolPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    for workers in steps:
        sizes.add(workers)  # update_connector_output
        assert RANK_BYTES not in workers.data  # nothing of it goes on to the front end
        scheduler = PoolConnectorStats(data={"histograms": sizes.take()})  # get_kv_connector_stats
        prom.observe(workers.aggregate(scheduler).data, 0)

    def sample(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, {"engine": "0", **labels}) or 0.0

    out = {}
    for op in (m.LOAD, m.SAVE):
        out[f"{op} size sum"] = sample(f"{m.TRANSFER_SIZE_BYTES.name}_sum", operation=op)
        out[f"{op} size count"] = sample(f"{m.TRANSFER_SIZE_BYTES.name}_count", operation=op)
        out[f"{op} bytes"] = sum(
            sample(m.TRANSFER_BYTES.exported, operation=op, group=str(g), group_kind=kind)
            for g, kind in enumerate(KINDS)
        )
    return out


def test_a_requests_transfer_size_is_its_bytes_over_every_rank() -> None:
    """Tensor parallel 2: both ranks load their shard of the same blocks. The histogram observes
    the request once, with what the bytes counter grew by: both ranks' bytes."""
    rank0 = stamped(0, replace(load_on_rank(), req_id="r1"))
    rank1 = stamped(1, replace(load_on_rank(missing=1), req_id="r1"))
    out = exported(worker_payload(rank0).aggregate(worker_payload(rank1)))
    assert out["load bytes"] == (10 + 9) * 512
    assert out["load size sum"] == out["load bytes"] and out["load size count"] == 1


def test_ranks_shares_that_arrive_in_other_steps_join() -> None:
    """Each rank's transfer ends on its own, so its share may reach the scheduler steps after
    another's; a request saved in two steps has two saves, each joined with its own."""
    r0_first, r0_second = (stamped(0, replace(save_on_rank(), req_id="r1")) for _ in range(2))
    r1_first = stamped(1, replace(save_on_rank(failed=4), req_id="r1"))
    r1_second = stamped(1, replace(save_on_rank(failed=10), req_id="r1"))
    other = stamped(0, replace(load_on_rank(), req_id="r2"))  # rank 1's share never arrives
    assert exported(worker_payload(r0_first, r0_second, other))["save size count"] == 0  # rank 1's not in
    out = exported(
        worker_payload(r0_first, r0_second, other), worker_payload(r1_first), worker_payload(r1_second)
    )
    assert out["save size count"] == 2
    assert out["save size sum"] == out["save bytes"] == (10 + 10 + 6 + 0) * 512
    assert out["load size count"] == 0  # r2's load waits for rank 1
    sizes = TransferSizes(ranks=2)
    sizes.add(worker_payload(r0_first, r0_second))
    sizes.add(worker_payload(r1_first))
    assert sizes.take() == {f"{m.TRANSFER_SIZE_BYTES.name}|operation=save": [(10 + 6) * 512]}


def test_transfers_a_rank_never_reports_are_dropped_past_the_limit() -> None:
    sizes = TransferSizes(ranks=2, limit=2)
    for req in "abc":  # rank 1 never reports "a" (it stopped): "a" goes to make room for "c"
        sizes.add(worker_payload(stamped(0, replace(load_on_rank(), req_id=req))))
    sizes.add(worker_payload(*(stamped(1, replace(load_on_rank(), req_id=req)) for req in "bc")))
    assert sizes.take() == {f"{m.TRANSFER_SIZE_BYTES.name}|operation=load": [2 * 10 * 512] * 2}
    assert sizes.take() == {}


def save_on_rank(*, failed: int = 0) -> TransferRecord:
    return TransferRecord(
        operation=m.SAVE,
        group_kinds=KINDS,
        blocks=(2 - min(failed, 2), 8 - max(0, failed - 2)),
        masked=(6, 0),
        bytes=((2 - min(failed, 2)) * 512, (8 - max(0, failed - 2)) * 512),
        failures={"transfer_failed": failed} if failed else {},
        seconds=0.02,
        group_failures=(
            {"transfer_failed": min(failed, 2)} if failed else {},
            {"transfer_failed": failed - 2} if failed > 2 else {},
        ),
        group_seconds=(0.005, 0.015),
        group_attempted=(True, True),
    )


def test_a_rank_that_fails_every_save_counts_each_failed_key() -> None:
    rank0 = PoolConnectorStats(data=records_to_data([], [stamped(0, save_on_rank())]))
    rank1 = PoolConnectorStats(data=records_to_data([], [stamped(1, save_on_rank(failed=10))]))
    total = rank0.aggregate(rank1)
    assert total.counter(m.FAILURES) == 10  # every key rank 1 failed to save
    assert total.counter(m.TRANSFER_KEYS) == 10  # rank 0's; rank 1 moved none
    assert total.counter(m.TRANSFER_BLOCKS) == 10  # the blocks, once
    by_group = {
        parse_key(key)[1]: value
        for key, value in total.data["counters"].items()
        if parse_key(key)[0] == m.FAILURES.name
    }
    assert by_group == {
        ("0", "sliding_window", m.SAVE, "transfer_failed"): 2.0,
        ("1", "full", m.SAVE, "transfer_failed"): 8.0,
    }
    assert total.reduce()["failures"] == 10


def test_the_scheduler_counts_what_vllm_recomputes_once() -> None:
    stats = StatsCollector(group_kinds=KINDS)
    record_recovery(stats, failed_requests=2, failed_blocks=0)
    record_recovery(stats, failed_requests=0, failed_blocks=3)
    record_recovery(stats, failed_requests=0, failed_blocks=0)
    total = PoolConnectorStats(data=records_to_data(*stats.drain()))
    assert total.counter(m.RECOMPUTED_REQUESTS) == 2
    assert total.counter(m.LOAD_ERROR_BLOCKS) == 3
    assert total.counter(m.TRANSFER_BLOCKS) == 0 and total.counter(m.FAILURES) == 0


def test_vllms_default_failure_policy_becomes_recompute() -> None:
    default = KVTransferConfig(kv_connector="KVPoolConnector", kv_role="kv_both")
    assert default.kv_load_failure_policy == "fail"  # vLLM's default: a failed load fails the request
    recompute_failed_loads(default)
    assert default.kv_load_failure_policy == "recompute"


def test_a_shutdown_grace_below_the_save_drain_is_named(monkeypatch) -> None:
    from types import SimpleNamespace

    from kvpool.connector.connector import warn_if_workers_stop_first

    def config(backend: str | None) -> SimpleNamespace:
        return SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend))

    monkeypatch.setenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "5")
    assert warn_if_workers_stop_first(config("mp"), 10.0)
    assert not warn_if_workers_stop_first(config("uni"), 10.0)  # one process: nothing stops first
    monkeypatch.setenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "60")
    assert not warn_if_workers_stop_first(config("mp"), 10.0)


def test_sleep_mode_with_caches_on_an_accelerator_is_named() -> None:
    """Fake configs and tensors (a GPU cannot run here): the warning depends only on the
    setting and the caches' device type."""
    from types import SimpleNamespace

    from kvpool.connector.connector import warn_if_sleep_mode_on_an_accelerator

    def config(sleep: bool) -> SimpleNamespace:
        return SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=sleep))

    gpu = {"layer.0": SimpleNamespace(device="cuda:0")}
    cpu = {"layer.0": SimpleNamespace(device="cpu")}
    assert warn_if_sleep_mode_on_an_accelerator(config(True), gpu)
    assert not warn_if_sleep_mode_on_an_accelerator(config(True), cpu)  # host memory stays
    assert not warn_if_sleep_mode_on_an_accelerator(config(False), gpu)


def test_a_block_two_ranks_report_failed_in_two_steps_counts_once(pool_client, cache_prefix) -> None:
    """Each rank reports its failed blocks when its own load ends: a block both ranks failed
    reaches the scheduler in two steps, and is one block vLLM recomputes."""
    from kvpool.connector.contract.keys import KeySpace
    from kvpool.connector.scheduler.request_state import RequestState
    from kvpool.connector.scheduler.side import SchedulerSide

    side = SchedulerSide(
        client=pool_client,
        keyspace=KeySpace(cache_prefix, "fp"),
        tp_size=2,
        pp_size=1,
        can_load=True,
        can_save=False,
        stats=StatsCollector(group_kinds=("full",)),
    )
    try:
        side.requests["r"] = RequestState(loading=True, loaded_blocks={5, 6})
        stats = StatsCollector(group_kinds=("full",))
        for finished, invalid in ((set(), {5}), ({"r"}, {5, 6})):  # rank 0's step, then rank 1's
            record_recovery(stats, 0, side.on_worker_output(finished, set(), invalid))
        total = PoolConnectorStats(data=records_to_data(*stats.drain()))
        assert total.counter(m.LOAD_ERROR_BLOCKS) == 2  # blocks 5 and 6, each once
        # Finished, its blocks may be another request's: a failure of them counts again.
        side.requests["q"] = RequestState(loading=True, loaded_blocks={5})
        assert side.on_worker_output({"q"}, set(), {5}) == 1
    finally:
        side.close()
