"""A run for :mod:`testing.engine_forks`'s tests: it starts processes it never stops (one
orphaned at once, one its own child), writes their PIDs, then returns or hangs."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    """``argv``: the spec (``{"hang": bool}``) and the result path (the PIDs it left)."""
    spec, result = json.loads(Path(argv[0]).read_text()), Path(argv[1])
    shell = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!"], stdout=subprocess.PIPE)
    assert shell.stdout is not None
    orphan = int(shell.stdout.readline())
    shell.wait()
    child = subprocess.Popen(["sleep", "300"])
    result.write_text(json.dumps({"pids": [orphan, child.pid]}))
    if spec["hang"]:
        time.sleep(300)
    return 0
