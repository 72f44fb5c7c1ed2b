"""Forked engine runs (testing.engine_forks): the same outputs as fresh processes, a deadline
that kills the run's whole process group, a run that ends with everything it started, and
fresh processes where the environment differs in what vLLM reads at import."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.connector.local.engine import run_module
from testing.engine import MODULE, EngineReport
from testing.engine_forks import (
    EngineForks,
    Replies,
    child_environment,
    import_time_differences,
    summary_line,
)
from testing.models import build_gemma3

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [[7 + (i * 13) % 500 for i in range(300)]]


LEAVER = "tests.testing.leaves_processes"


@pytest.mark.parametrize("hang", [False, True], ids=["returns", "outlives_its_deadline"])
def test_a_run_ends_with_every_process_it_started(tmp_path: Path, hang: bool) -> None:
    """What a run leaves behind (an orphan, a child it never waited for) is killed and
    reaped before its exit code comes back: nothing of its process group is left, not
    even a zombie for init to collect later."""
    env = child_environment({"PYTHONPATH": str(ROOT)})
    forks = EngineForks(env, warm_imports=())
    spec_path, result, log = tmp_path / "spec.json", tmp_path / "result.json", tmp_path / "run.log"
    spec_path.write_text(json.dumps({"hang": hang}))
    pids: list[int] = []
    try:
        if hang:
            with pytest.raises(subprocess.TimeoutExpired):
                forks.run(LEAVER, spec_path, result, log, env, timeout=10)
        else:
            assert forks.run(LEAVER, spec_path, result, log, env, timeout=60) == 0
        pids = json.loads(result.read_text())["pids"]
        assert forks.last_pid is not None
        with pytest.raises(ProcessLookupError):
            os.killpg(forks.last_pid, 0)
        assert [pid for pid in pids if Path(f"/proc/{pid}").exists()] == []
    finally:
        forks.stop()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


SEMAPHORE_LEAVER = "tests.testing.leaves_a_semaphore"


def test_a_run_that_killed_a_worker_leaves_no_semaphore(tmp_path: Path) -> None:
    """A worker the run SIGKILLed left its semaphore to the run's resource tracker: the run's
    end kills the rest of its group first, and the tracker unlinks the name before it ends."""
    env = child_environment({"PYTHONPATH": str(ROOT)})
    forks = EngineForks(env, warm_imports=())
    spec_path, result, log = tmp_path / "spec.json", tmp_path / "result.json", tmp_path / "run.log"
    spec_path.write_text("{}")
    left: dict[str, Any] = {"semaphore": "", "pids": []}
    try:
        assert forks.run(SEMAPHORE_LEAVER, spec_path, result, log, env, timeout=60) == 0
        left = json.loads(result.read_text())
        assert left["semaphore"], log.read_text()
        assert not os.path.exists(f"/dev/shm/sem.{left['semaphore'].lstrip('/')}"), "the tracker unlinked it"
        assert [pid for pid in left["pids"] if Path(f"/proc/{pid}").exists()] == []
    finally:
        forks.stop()
        for pid in left["pids"]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if left["semaphore"]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/sem.{left['semaphore'].lstrip('/')}")


def test_only_run_time_variables_may_differ() -> None:
    parent = {"PATH": "/bin", "PYTHONHASHSEED": "0", "VLLM_LOGGING_LEVEL": "INFO"}
    assert import_time_differences(parent, parent) == set()
    assert (
        import_time_differences(parent, {**parent, "PYTHONHASHSEED": "11", "MC_TCP_BIND_ADDRESS": "x"})
        == set()
    )
    otel = {**parent, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "LD_PRELOAD": "libgomp.so.1"}
    assert import_time_differences(parent, otel) == set()
    assert import_time_differences(parent, {**parent, "VLLM_LOGGING_LEVEL": "DEBUG"}) == {
        "VLLM_LOGGING_LEVEL"
    }
    assert import_time_differences(parent, {k: v for k, v in parent.items() if k != "PATH"}) == {"PATH"}


def test_replies_that_arrive_together_are_each_read_at_once() -> None:
    """A run that ends at once (its pid and its exit code in one write) is not waited on
    until its deadline."""
    both = 'import sys; sys.stdout.write(\'{"pid": 1}\\n{"rc": 3}\\n\'); sys.stdout.flush(); sys.stdin.read()'
    proc = subprocess.Popen(
        [sys.executable, "-c", both], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
    )
    try:
        replies = Replies(proc)
        assert replies.next(30.0) == {"pid": 1}
        assert replies.next(0.5) == {"rc": 3}
        with pytest.raises(TimeoutError):
            replies.next(0.2)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)
    with pytest.raises(RuntimeError, match="exited"):
        replies.next(5.0)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3(tmp_path_factory.mktemp("models") / "gemma3-tiny")


@pytest.fixture
def forks() -> Iterator[EngineForks]:
    forks = EngineForks(child_environment({"PYTHONPATH": str(ROOT)}))
    yield forks
    forks.stop()


def _tokens(result: Path) -> list[list[int]]:
    return EngineReport.from_json(json.loads(result.read_text())).token_ids


@pytest.mark.engine
def test_a_forked_run_gives_a_fresh_runs_tokens_and_a_deadline_kills_it(
    forks: EngineForks, gemma3_dir: Path, tmp_path: Path
) -> None:
    spec = {"opts": {"model": str(gemma3_dir)}, "batches": [PROMPT], "max_tokens": 8}
    spec |= {"logprobs": False, "trace_headers": None}
    fresh = EngineReport.from_json(run_module(MODULE, spec, env={"PYTHONPATH": str(ROOT)})).token_ids
    spec_path, result, log = tmp_path / "spec.json", tmp_path / "result.json", tmp_path / "engine.log"
    spec_path.write_text(json.dumps(spec))
    env = child_environment({"PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "5"})
    assert forks.accepts(env)
    assert forks.run(MODULE, spec_path, result, log, env, timeout=300) == 0
    assert _tokens(result) == fresh
    assert forks.forked_runs == 1
    # Past its deadline the run is killed, its process group with it; the parent forks on.
    result.unlink()
    with pytest.raises(subprocess.TimeoutExpired):
        forks.run(MODULE, spec_path, result, log, env, timeout=0.5)
    assert forks.last_pid is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(forks.last_pid, 0)
    assert not result.exists()
    assert forks.run(MODULE, spec_path, result, log, env, timeout=300) == 0
    assert _tokens(result) == fresh
    assert forks.forked_runs == 3


def test_a_run_that_changes_an_import_time_variable_is_not_forked(forks: EngineForks) -> None:
    assert not forks.accepts(child_environment({"PYTHONPATH": str(ROOT), "VLLM_LOGGING_LEVEL": "DEBUG"}))


def test_the_report_line_sums_each_process() -> None:
    line = summary_line(
        [
            {"forked": 3, "fresh_because": {"VLLM_LOGGING_LEVEL": 1}},
            {"forked": 2, "fresh_because": {"VLLM_LOGGING_LEVEL": 1, "(the parent was busy)": 1}},
        ]
    )
    assert line == (
        "engine processes: 5 forked from a parent that imported vLLM; others started fresh "
        "because of VLLM_LOGGING_LEVEL (2), (the parent was busy) (1)"
    )
    alone = summary_line([{"forked": 0, "fresh_because": {}}])
    assert alone == "engine processes: 0 forked from a parent that imported vLLM"
