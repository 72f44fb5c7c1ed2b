"""Layouts that check themselves, end to end on real vLLM engines and a real pool.

``kvpool-layout`` prints the tiny hybrid Gemma3's layout; a ``MooncakeKVPool``
declares it for its consumer; the operator renders that consumer's connector
settings (the declared layout and its fingerprint); engines started with them:

* declared = built: engine A stores P1, engine B (a fresh process) takes the shared
  prefix of P2 from the pool;
* declared ≠ built (the window and the dtype wrong): engine C logs one error naming
  both fields, counts them in ``vllm:kvpool_layout_mismatches``, and stays out of the
  pool (``vllm:kvpool_in_pool`` 0): no lookup, no transfer, nothing cached. Its output
  is therefore P2 computed without the pool, and B's output, computed with it, equals it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from kvpool.connector.contract.layout import KVLayout, fingerprint
from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.operator.plan import build_plan
from testing.child_processes import children, kill_leftovers, running
from testing.engine import EngineOptions, run_engine_subprocess, transfer_config
from testing.models import build_gemma3
from testing.operator_objects import pool_spec
from testing.prompts import BLOCK, MAX_TOKENS, P1, P2, PREFIX_HIT

pytestmark = [pytest.mark.engine, pytest.mark.mooncake]

DTYPE = "float32"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3(tmp_path_factory.mktemp("layout-gemma3"))


@pytest.fixture(scope="module")
def printed_layout(model_dir: Path) -> KVLayout:
    """What ``kvpool-layout`` prints for the model and the engines' flags."""
    result = subprocess.run(
        [sys.executable, "-m", "kvpool.connector.local.layout_command", "--model", str(model_dir),
         "--block-size", str(BLOCK), "--dtype", DTYPE, "--format", "json"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "# fingerprint" in result.stderr
    return KVLayout.model_validate(json.loads(result.stdout))


def rendered_settings(layout: KVLayout, pool_settings: ConnectorSettings) -> ConnectorSettings:
    """The consumer's settings as the operator renders them, pointed at the local pool."""
    spec = pool_spec(
        consumers=[{"name": "llm", "layout": layout.model_dump(mode="json", exclude_defaults=True)}]
    )
    (injection,) = build_plan("pool", "team-a", spec).consumers
    extra = json.loads(injection.kv_transfer_config)["kv_connector_extra_config"]
    assert extra["declared_layout_fingerprint"] == fingerprint(layout) == injection.layout_fingerprint
    # A pod's address and the pool's Service name, as this machine reaches the local pool.
    extra.update(
        local_hostname="127.0.0.1",
        bind_address="127.0.0.1",
        master_server_address=pool_settings.master_server_address,
        cache_prefix=pool_settings.cache_prefix,
    )
    return ConnectorSettings.parse(extra)


def options(model_dir: Path, settings: ConnectorSettings, **extra: Any) -> EngineOptions:
    return EngineOptions(
        model=str(model_dir), kv_transfer_config=transfer_config(settings), dtype=DTYPE, **extra
    )


def test_declared_layout_is_used_or_refused(model_dir, printed_layout, pool_settings, tmp_path) -> None:
    right = rendered_settings(printed_layout, pool_settings)

    # Declared = built: the pool is used.
    run_engine_subprocess(options(model_dir, right), [[P1]], MAX_TOKENS)
    b = run_engine_subprocess(options(model_dir, right), [[P2]], MAX_TOKENS)
    assert b.results[0].num_cached_tokens == PREFIX_HIT  # a fresh process: all from the pool
    assert any(t["operation"] == "load" and sum(t["blocks"]) for t in b.transfers)

    # Declared ≠ built: refused, with the message and the metric.
    wrong_group = printed_layout.groups[0].model_copy(update={"sliding_window": 2 * BLOCK * 4})
    wrong_layout = printed_layout.model_copy(
        update={"dtype": "bfloat16", "groups": [wrong_group, *printed_layout.groups[1:]]}
    )
    wrong = rendered_settings(wrong_layout, pool_settings)
    log = tmp_path / "engine-c.log"
    c = run_engine_subprocess(
        options(model_dir, wrong, disable_log_stats=False), [[P2]], MAX_TOKENS, log_path=log
    )
    assert c.results[0].num_cached_tokens == 0
    assert c.lookups == [] and c.transfers == []
    text = log.read_text(errors="replace")
    assert "the declared KV layout is not the one vLLM built" in text
    assert "staying out of the pool" in text
    assert "dtype: declared 'bfloat16', vLLM built 'float32'" in text
    built_window = printed_layout.groups[0].sliding_window
    assert f"groups[0].sliding_window: declared {2 * BLOCK * 4}, vLLM built {built_window}" in text
    assert c.metrics is not None
    mismatches = {k: v for k, v in c.metrics.items() if "layout_mismatches" in k and "{" in k}
    assert mismatches == {
        "vllm:kvpool_layout_mismatches{field=dtype}": 1.0,
        "vllm:kvpool_layout_mismatches{field=groups[0].sliding_window}": 1.0,
    }, c.metrics
    assert c.metrics["vllm:kvpool_in_pool"] == 0.0

    # C computed P2 without the pool; B, with it, gave the same tokens.
    assert b.token_ids == c.token_ids


def test_tensor_parallel_ranks_build_their_share(model_dir, printed_layout) -> None:
    """``-tp 2`` runs two ranks (gloo on loopback): each holds half the KV heads, so half a page.
    What their vLLM leaves in the temporary folder (its message queues' IPC sockets) goes with them."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}  # vLLM's default: TMPDIR
    # In the system's temporary folder: a short path, as vLLM's socket paths need.
    with tempfile.TemporaryDirectory(prefix="kvpool-test-") as temp:
        result = subprocess.run(
            [sys.executable, "-m", "kvpool.connector.local.layout_command", "--model", str(model_dir),
             "--block-size", str(BLOCK), "--dtype", DTYPE, "--format", "json", "-tp", "2"],
            capture_output=True, text=True, timeout=900, env={**env, "TMPDIR": temp},
        )  # fmt: skip
        left = [p.name for p in Path(temp).iterdir() if not p.name.startswith("torchinductor_")]
    assert result.returncode == 0, result.stderr[-3000:]
    assert left == []  # torch's own per-user cache folder aside, kept like any torch program's
    tp2 = KVLayout.model_validate(json.loads(result.stdout))
    assert tp2.tp_size == 2
    halved = [g.model_copy(update={"page_size_bytes": g.page_size_bytes // 2}) for g in printed_layout.groups]
    assert tp2.groups == halved
    assert tp2.model_copy(update={"tp_size": 1, "groups": printed_layout.groups}) == printed_layout


def test_a_block_size_the_backends_cannot_run_is_refused(model_dir) -> None:
    """vLLM's CPU engine accepts ``--block-size 7`` in its config, then its worker refuses it
    (CPU attention runs multiples of 32): no layout is printed for flags no server starts with."""
    result = subprocess.run(
        [sys.executable, "-m", "kvpool.connector.local.layout_command", "--model", str(model_dir),
         "--block-size", "7", "--dtype", DTYPE],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stdout == ""
    assert "kvpool-layout: error: --block-size: a size vLLM's attention backends on this platform run: " in (
        result.stderr
    )
    assert "No common block size for 7 (CPU_ATTN: [MultipleOf(32)])" in result.stderr


def _start_tp2_layout(model_dir: Path, temp: str, **streams: Any) -> subprocess.Popen[str]:
    """``kvpool-layout -tp 2`` with ``temp`` as its temporary folder (``streams``: its stdout and stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}
    command = [sys.executable, "-m", "kvpool.connector.local.layout_command", "--model", str(model_dir),
               "--block-size", str(BLOCK), "--dtype", DTYPE, "-tp", "2"]  # fmt: skip
    return subprocess.Popen(command, text=True, env={**env, "TMPDIR": temp}, **streams)


def _wait_for_ranks(process: subprocess.Popen[str], segments: str, ranks: list[int]) -> None:
    """Until both ranks of ``process`` run in their group (each with its shared memory, named
    ``segments``...); their PIDs are in ``ranks`` meanwhile (for a failed wait's clean-up)."""
    deadline = time.monotonic() + 600
    while len(ranks) < 2 or len(_shared_memory(segments)) < 2:
        assert process.poll() is None and time.monotonic() < deadline, "no ranks in a group"
        time.sleep(0.05)
        ranks[:] = [
            pid for pid, command in children(process.pid).items() if b"spawn_main" in b" ".join(command)
        ]


def test_sigterm_stops_the_ranks_and_removes_their_files(model_dir) -> None:
    """Python's default SIGTERM ended the command alone: its ranks ran on, orphaned, and left
    their sockets in the temporary folder. Stopped in their group, the ranks' CPU communicator
    then left its shared memory (8 MB a rank) in /dev/shm for good."""
    with tempfile.TemporaryDirectory(prefix="kvpool-test-") as temp:
        process = _start_tp2_layout(model_dir, temp, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        segments = f"kvpool-layout-{process.pid}-"  # the probe's VLLM_DIST_IDENT
        ranks: list[int] = []
        try:
            _wait_for_ranks(process, segments, ranks)
            for pid in ranks:  # held in their group until they are stopped
                os.kill(pid, signal.SIGSTOP)
            process.send_signal(signal.SIGTERM)
            out, err = process.communicate(timeout=600)
            assert [pid for pid in ranks if running(pid)] == []
            assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
            assert "kvpool-layout: stopped by SIGTERM" in err
            assert out == ""
            assert _shared_memory(segments) == []
        finally:
            kill_leftovers(process, ranks)
            for name in _shared_memory(segments):
                os.unlink(f"/dev/shm/{name}")
        left = [p.name for p in Path(temp).iterdir() if not p.name.startswith("torchinductor_")]
    assert left == []


def test_sigkill_takes_the_ranks_and_their_shared_memory_with_it(model_dir) -> None:
    """A SIGKILLed command (the OOM killer, ``timeout -s KILL``) left its ranks running, orphaned,
    and their CPU communicator's shared memory in /dev/shm. The ranks are stopped (SIGSTOP) in
    their group first: they stand for ranks that do not end on their own."""
    with tempfile.TemporaryDirectory(prefix="kvpool-test-") as temp:
        process = _start_tp2_layout(model_dir, temp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        segments = f"kvpool-layout-{process.pid}-"  # the probe's VLLM_DIST_IDENT
        ranks: list[int] = []
        try:
            _wait_for_ranks(process, segments, ranks)
            for pid in ranks:
                os.kill(pid, signal.SIGSTOP)
            process.kill()
            process.wait()
            deadline = time.monotonic() + 120
            while [pid for pid in ranks if running(pid)] or _shared_memory(segments):
                assert time.monotonic() < deadline, (ranks, _shared_memory(segments))
                time.sleep(0.05)
        finally:
            kill_leftovers(process, ranks)
            for name in _shared_memory(segments):
                os.unlink(f"/dev/shm/{name}")


def _shared_memory(prefix: str) -> list[str]:
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(prefix))


def test_a_kernel_check_failing_for_another_reason_is_not_called_a_block_size(monkeypatch) -> None:
    """Only vLLM's "no common block size" refusal is a ``--block-size`` usage error; any other
    failure of its check is the probe's own error, whole."""
    import vllm.v1.worker.utils

    from kvpool.connector.local import layout_probe

    def failing(*_: Any) -> list[int]:
        raise ValueError("an unrelated failure")

    monkeypatch.setattr(vllm.v1.worker.utils, "prepare_kernel_block_sizes", failing)
    config = type("Config", (), {"kv_cache_groups": []})()
    with pytest.raises(layout_probe.ProbeError, match="an unrelated failure") as raised:
        layout_probe.check_kernel_block_sizes([config], [{}], [{}])
    assert not isinstance(raised.value, layout_probe.UnsupportedBlockSize)
