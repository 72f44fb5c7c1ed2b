"""``kvpool-layout`` refuses bad arguments before it starts a rank (most before it imports vLLM).

The layout it prints, and a block size vLLM's backends refuse, are
``tests/connector/integrity/test_layout_whole_path.py``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpool.connector.local import layout_command

COMMAND = [sys.executable, "-m", "kvpool.connector.local.layout_command"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--block-size", "0"], "--block-size: at least 1"),
        (["--block-size", "-16"], "--block-size: at least 1"),
        (["--block-size", "16x"], "argument --block-size: invalid int value: '16x'"),
        (["--max-model-len", "0"], "--max-model-len: at least 1"),
        (["-tp", "0"], "--tensor-parallel-size: at least 1"),
        (["-pp", "-1"], "--pipeline-parallel-size: at least 1"),
        (["--engine-arg", "no-equals"], "--engine-arg 'no-equals': use NAME=VALUE"),
        (["--format", "toml"], "argument --format: invalid choice: 'toml'"),
        (
            ["-tp", "2", "--engine-arg", "tensor_parallel_size=1"],
            "--engine-arg tensor_parallel_size: use --tensor",
        ),
        (
            ["--engine-arg", "block_size=16"],
            "--engine-arg block_size: use --block-size (an option of its own)",
        ),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        layout_command.main(["--model", "/nonexistent/model", *args])
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert message in err
    assert out == ""


def test_an_engine_arg_vllm_does_not_have_is_refused_before_any_rank_starts() -> None:
    """It was a ``TypeError`` from ``EngineArgs`` (exit status 1), after the command said nothing
    of the option; vLLM's fields are known once vLLM is imported, before any rank starts."""
    result = subprocess.run(
        [*COMMAND, "--model", "/nonexistent/model", "--engine-arg", "mamba_cach_mode=align"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2
    assert (
        "kvpool-layout: error: --engine-arg mamba_cach_mode: not a field of vLLM's EngineArgs"
        in result.stderr
    )
    assert result.stdout == ""
