"""An idle engine step with loads in flight pauses, briefly and boundedly, for them.

Without the pause an in-process engine waiting only for asynchronous loads steps
back to back holding the GIL, and the loads crawl (the TTFT benchmark measures
it). No Mooncake here: the loads are futures the test controls.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from kvpool.connector.integrity.deadlines import IDLE_STEP_WAIT_S
from kvpool.connector.metadata import PoolConnectorMetadata, runs_no_forward
from kvpool.connector.worker import side as worker_side
from testing.worker import loads_in_flight, single_group_worker, transfer_threads


@pytest.fixture
def worker() -> Any:
    w = single_group_worker(None, "idle", num_blocks=4)
    yield w
    transfer_threads(w).shutdown(wait=False)


@pytest.fixture
def waits(monkeypatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    real = worker_side.wait

    def recording_wait(futures: Any, timeout: float | None = None, return_when: str = "") -> Any:
        calls.append({"futures": list(futures), "timeout": timeout, "return_when": return_when})
        return real(futures, timeout=timeout, return_when=return_when)

    monkeypatch.setattr(worker_side, "wait", recording_wait)
    return calls


def test_an_idle_step_waits_for_loads_in_flight_with_a_deadline(worker, waits) -> None:
    stuck: Future[bool] = Future()  # a load that never returns
    loads_in_flight(worker)["r1"] = stuck
    assert worker.transfer_results(idle=True) == (set(), set())  # returned: bounded
    assert len(waits) == 1
    assert waits[0]["futures"] == [stuck]
    assert waits[0]["timeout"] == IDLE_STEP_WAIT_S
    assert waits[0]["return_when"] == worker_side.FIRST_COMPLETED


def test_a_step_with_a_forward_or_nothing_in_flight_never_pauses(worker, waits) -> None:
    loads_in_flight(worker)["r1"] = Future()
    worker.transfer_results(idle=False)
    done: Future[bool] = Future()
    done.set_result(True)
    loads_in_flight(worker)["r1"] = done
    worker.transfer_results(idle=True)
    assert waits == []


def test_the_connector_calls_a_step_without_scheduled_tokens_idle() -> None:
    assert runs_no_forward(PoolConnectorMetadata(forward_tokens=0))
    assert not runs_no_forward(PoolConnectorMetadata(forward_tokens=16))
    assert not runs_no_forward(None)  # no metadata bound: not known to be idle


class _RecordingPresence:
    """Records the scheduler side's waits; stands in for its presence service (no pool here)."""

    def __init__(self) -> None:
        self.waits: list[tuple[float, bool]] = []

    def flush(self) -> None:
        pass

    def wait_idle(self, timeout_s: float, *, lookups_only: bool = False) -> bool:
        self.waits.append((timeout_s, lookups_only))
        return True

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("tokens", "waits"), [(0, [(IDLE_STEP_WAIT_S, True)]), (16, [])])
def test_an_idle_scheduler_step_lets_its_lookups_be_answered(
    tokens: int, waits: list[tuple[float, bool]]
) -> None:
    from types import SimpleNamespace

    from kvpool.connector.contract.keys import KeySpace
    from kvpool.connector.integrity.layout_verdict import OutOfPool
    from kvpool.connector.observability.records import StatsCollector
    from kvpool.connector.scheduler.side import SchedulerSide

    side = SchedulerSide(
        client=OutOfPool(),  # type: ignore[arg-type]
        keyspace=KeySpace("p", "0123456789abcdef"),
        tp_size=1,
        pp_size=1,
        can_load=True,
        can_save=False,
        stats=StatsCollector(group_kinds=("full",)),
    )
    side.close()
    side.presence = recording = _RecordingPresence()  # type: ignore[assignment]
    meta = side.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=tokens), lambda _: [])
    assert meta.forward_tokens == tokens
    assert recording.waits == waits  # bounded, and for the lookups only
