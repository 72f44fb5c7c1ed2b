"""Tensor-parallel ranks: counters once per request and group, bytes physical; the policies TP needs.

Every rank of an engine moves the same blocks of a request (each its share of the KV
heads, under its own keys): rank 0 counts the blocks and latencies, every rank adds its
bytes, the keys it moved and those that failed, and what vLLM recomputes after failed
loads (the union over ranks) is counted once by the scheduler. The real-engine check is
in ``test_tensor_parallel.py``.
"""

from __future__ import annotations

from vllm.config.kv_transfer import KVTransferConfig

from kvpool.connector.connector import recompute_failed_loads, record_recovery
from kvpool.connector.contract import metric_names as m
from kvpool.connector.observability.records import StatsCollector, TransferRecord
from kvpool.connector.observability.vllm_metrics import PoolConnectorStats, parse_key, records_to_data

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
