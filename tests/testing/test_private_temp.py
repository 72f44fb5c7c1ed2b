"""The run's private temporary folder: what the processes it starts leave there goes at its exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from testing.engine import REPO_ROOT

#: A run: its folder, what a process it starts sees as the temporary folder, and a forked
#: child that leaves a file there (as a killed server would) and exits (the folder stays).
RUN = """
import json, os, subprocess, sys, tempfile
from testing.private_temp import use_private_temp_folder
folder = use_private_temp_folder()
child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
                       capture_output=True, text=True, check=True).stdout.strip()
pid = os.fork()
if pid == 0:
    open(os.path.join(os.environ["VLLM_RPC_BASE_PATH"], "socket-of-a-killed-server"), "w").close()
    sys.exit(0)  # a normal exit: the parent's folder stays
os.waitpid(pid, 0)
print(json.dumps({"folder": str(folder), "child_temp": child, "own_temp": tempfile.gettempdir(),
                  "after_fork": os.path.isdir(folder),
                  "left": os.listdir(folder)}))
"""


JOIN = """
import json, os, subprocess, sys, tempfile
from testing.private_temp import use_private_temp_folder
joined = use_private_temp_folder() is None
child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
                       capture_output=True, text=True, check=True).stdout.strip()
print(json.dumps({"joined": joined, "rpc": os.environ["VLLM_RPC_BASE_PATH"], "child_temp": child,
                  "own_temp": tempfile.gettempdir()}))
"""


def _run(env: dict[str, str], *, join: bool = False) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", JOIN if join else RUN],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO_ROOT,
        env={**os.environ, **env, "PYTHONPATH": str(REPO_ROOT)},
        timeout=60,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_what_started_processes_leave_goes_with_the_run(tmp_path: Path) -> None:
    system = tmp_path / "system-temp"
    system.mkdir()
    got = _run({"TMPDIR": str(system), "KVPOOL_SYSTEM_TMPDIR": ""})
    folder = Path(got["folder"])
    assert folder.parent == system
    assert got["child_temp"] == str(folder), "processes the run starts use the private folder"
    assert got["own_temp"] == str(system), "the run keeps the system's folder for its own files"
    assert got["after_fork"] and got["left"] == ["socket-of-a-killed-server"], "a fork removes nothing"
    assert not folder.exists(), "removed, with what was left in it, at the run's exit"


def test_a_process_a_run_starts_joins_it(tmp_path: Path) -> None:
    """pytest's workers and a benchmark's helper processes inherit the run's variables: they
    make no folder and change neither (the lookup benchmark points vLLM at a folder its
    in-tree worker process must share), and keep the system's folder for their own files."""
    system = tmp_path / "system-temp"
    run_folder = system / "kvpool-run-outer"
    shared = system / "benchmark-ipc"
    run_folder.mkdir(parents=True)
    shared.mkdir()
    got = _run(
        {"TMPDIR": str(run_folder), "VLLM_RPC_BASE_PATH": str(shared), "KVPOOL_SYSTEM_TMPDIR": str(system)},
        join=True,
    )
    assert got == {"joined": True, "rpc": str(shared), "child_temp": str(run_folder), "own_temp": str(system)}
    assert run_folder.is_dir(), "the run's folder is the run's to remove"
