"""``kvpool-layout`` refuses bad arguments before it imports vLLM or starts a rank.

The layout it prints, and a block size vLLM's backends refuse, are
``tests/connector/integrity/test_layout_whole_path.py``.
"""

from __future__ import annotations

import pytest

from kvpool.connector.local import layout_command


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
