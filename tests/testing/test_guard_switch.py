"""The test-only payload-check switch: off only in a process started with its environment,
and only while its file exists."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from testing.guard_switch import server_env

PROBE = """
from pathlib import Path
import sys
from kvpool.connector.contract.object_header import HEADER_BYTES, payload_matches as real
from kvpool.connector.worker import staging
switch = Path(sys.argv[1])
print(staging.payload_matches is real)
header = bytes(HEADER_BYTES)  # states no checksum the probe's value matches
print(staging.payload_matches(header, None, 12345))
switch.touch()
print(staging.payload_matches(header, None, 12345))
switch.unlink()
print(staging.payload_matches(header, None, 12345))
"""


def probe(env: dict[str, str], switch: Path) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(switch)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.split()


def test_the_switch_turns_the_check_off_while_its_file_exists(tmp_path: Path) -> None:
    switch = tmp_path / "payload-check-off"
    assert probe(server_env(switch, tmp_path / "site"), switch) == ["False", "False", "True", "False"]


def test_without_its_environment_nothing_changes(tmp_path: Path) -> None:
    switch = tmp_path / "payload-check-off"
    assert probe({}, switch) == ["True", "False", "False", "False"]
