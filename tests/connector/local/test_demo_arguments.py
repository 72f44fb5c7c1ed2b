"""``kvpool-demo`` refuses bad arguments before it builds or starts anything.

The demo itself (a pool and three real engines) runs as the README's quick start; here only
its refusals, which must come before the model is built, the pool started or an engine run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvpool.connector.local import demo


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefix-len", "-5"], "--prefix-len: at least 32"),
        (["--prefix-len", "0"], "--prefix-len: at least 32"),
        (["--prefix-len", "31"], "--prefix-len: at least 32"),
        (["--max-tokens", "0"], "--max-tokens: at least 1"),
        (["--prefix-len", "1000"], "--prefix-len: at most 962 with --max-tokens 12"),
        (["--prefix-len", "900", "--max-tokens", "100"], "--prefix-len: at most 874 with --max-tokens 100"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = tmp_path / "model"
    with pytest.raises(SystemExit) as exited:
        demo.main(["--model-dir", str(model_dir), *args])
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert message in err
    assert out == ""  # nothing ran: no "model:" line, no pool
    assert not model_dir.exists()


def test_the_longest_prefix_allowed_is_accepted() -> None:
    demo._check(argparse.ArgumentParser(), argparse.Namespace(prefix_len=962, max_tokens=12))


def test_a_model_dir_that_cannot_be_made_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert demo.main(["--model-dir", str(blocker / "model")]) == 1
    out, err = capsys.readouterr()
    assert f"kvpool-demo: --model-dir {blocker / 'model'}: cannot build the model there" in err
    assert "pool:" not in out  # no pool was started
