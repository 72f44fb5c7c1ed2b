"""A folder of the run's own for what vLLM leaves in the temporary folder; removed at exit.

vLLM puts its ZMQ IPC sockets under ``$VLLM_RPC_BASE_PATH`` and its rendezvous files
(``vllm_dist_*``) in the temporary folder; a process stopped before it closes them (an
API server or engine core a test stops, a tensor-parallel worker) leaves them behind. A
test or benchmark run makes a new folder before it starts any engine, points both at it
(``VLLM_RPC_BASE_PATH``, and ``TMPDIR`` for the processes it starts) and removes it, with
whatever is left in it, when it exits. A test or benchmark process that such a run starts
(pytest's workers, a benchmark's helper process) joins the run: it makes no folder and
changes neither variable (a benchmark may have pointed vLLM at a folder its processes
share). Each keeps the system's temporary folder for its own files (pytest's kept
folders, an end-to-end run's folder kept after a failure).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

#: vLLM's folder for IPC sockets; the temporary folder of the processes started.
VARIABLES = ("VLLM_RPC_BASE_PATH", "TMPDIR")
#: The system's temporary folder, set by the run for the processes it starts.
SYSTEM_TEMP = "KVPOOL_SYSTEM_TMPDIR"


def use_private_temp_folder() -> Path | None:
    """A new folder, named by :data:`VARIABLES` in ``os.environ`` and removed at this process's
    exit (not at a forked child's, which shares it); None in a process a run started."""
    started_by_a_run = os.environ.get(SYSTEM_TEMP)
    if started_by_a_run:
        tempfile.tempdir = started_by_a_run  # its own files stay where they always were
        return None
    system = tempfile.gettempdir()  # resolved now, and kept for this process's own files
    os.environ[SYSTEM_TEMP] = system
    folder = Path(tempfile.mkdtemp(prefix="kvpool-run-", dir=system))
    for name in VARIABLES:
        os.environ[name] = str(folder)
    atexit.register(_remove, folder, os.getpid())
    return folder


def _remove(folder: Path, owner_pid: int) -> None:
    if os.getpid() == owner_pid:
        shutil.rmtree(folder, ignore_errors=True)
