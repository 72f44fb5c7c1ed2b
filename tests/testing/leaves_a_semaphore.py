"""A run for :mod:`testing.engine_forks`'s tests, like vLLM's executor after its shutdown
SIGKILLed a lingering worker: the worker's semaphore (spawn's, named) is left to the run's
resource tracker, and a child the run never stops still holds the tracker's pipe."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

#: The worker: a named semaphore, its name to the run, then it waits to be killed.
WORKER = """
import multiprocessing, time
lock = multiprocessing.get_context("spawn").Lock()
conn.send(lock._semlock.name)
time.sleep(300)
"""


def main(argv: list[str]) -> int:
    """``argv``: the spec (unused) and the result path (the semaphore's name, the child's PID)."""
    result = Path(argv[1])
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    worker = context.Process(target=exec, args=(WORKER, {"conn": theirs}))
    worker.start()
    name = ours.recv()
    os.kill(worker.pid, signal.SIGKILL)  # type: ignore[arg-type]
    worker.join()
    holder = os.fork()  # keeps the tracker's pipe open: the tracker waits until it is gone
    if holder == 0:
        time.sleep(300)
        os._exit(0)
    result.write_text(json.dumps({"semaphore": name, "pids": [holder]}))
    return 0
