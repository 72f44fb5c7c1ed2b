"""Engine processes forked from a parent that has already imported vLLM.

Importing vLLM costs about 9 s of the 15 s a fresh engine process takes on these
machines (a forked one takes about 6 s), and the test suite starts a few dozen. :class:`EngineForks`
starts one parent (``python -m testing.engine_forks``), which imports vLLM and
torch, runs nothing, and forks a child per engine run: the child sets the run's
environment, sends its output to the run's log, runs ``MODULE.main([SPEC,
RESULT])`` and exits as a fresh process would (its exit handlers run). The parent
stays as it was after the imports, so every child starts from the same state. A run
ends with its process group: the parent is its descendants' subreaper, and it kills
and reaps whatever the run left behind before it sends the run's exit code.

A run goes to a fresh process instead (:func:`run_module` as before) when its
environment differs from the parent's in anything vLLM or torch may read at
import (only :data:`READ_AT_RUN_TIME` and what vLLM sets itself,
:data:`SET_BY_VLLM_AT_RUN_TIME`, may differ), or while another thread's run holds
the parent. The tests turn this on (``tests/conftest.py``); the benchmarks keep
fresh processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import IO, Any

from kvpool.connector.local.engine import ENGINE_ENV
from testing import child_processes

#: Environment variables read when an engine is created or later, never at import: a
#: forked run may set them to other values than the parent's.
READ_AT_RUN_TIME = (
    "PYTHONHASHSEED",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS",
)
READ_AT_RUN_TIME_PREFIXES = ("MC_", "KVPOOL_", "OTEL_", "PYTEST_")
#: What vLLM sets in ``os.environ`` of a process that creates an engine (for the processes it
#: starts): a test process that ran one in-process passes them on, and a forked run of vLLM
#: sets them again itself, as a fresh one would.
SET_BY_VLLM_AT_RUN_TIME = (
    "AITER_SITUV2_A4W4",
    "LD_LIBRARY_PATH",
    "LD_PRELOAD",
    "LOCAL_WORLD_SIZE",
    "NUMEXPR_MAX_THREADS",
    "PYTORCH_NVML_BASED_CUDA_CHECK",
    "TILELANG_CLEANUP_TEMP_FILES",
    "TORCHINDUCTOR_CACHE_DIR",
    "TORCHINDUCTOR_COMPILE_THREADS",
    "TORCHINDUCTOR_CPP_DYNAMIC_THREADS",
    "TRITON_CACHE_AUTOTUNING",
    "VLLM_DISABLE_SHARED_EXPERTS_STREAM",
    "VLLM_DIST_IDENT",
    "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME",
    "VLLM_WORKER_MULTIPROC_METHOD",
    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
)
#: What the parent imports before it forks anything (no module that starts threads).
WARM_IMPORTS = (
    "torch",
    "vllm.entrypoints.llm",
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.attention.backends.cpu_attn",
    "vllm.v1.attention.backends.mamba_attn",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.models.gemma3",  # the tests' models
    "vllm.model_executor.models.gpt_oss",
)
#: The longest the parent may take to import them.
START_TIMEOUT_S = 300.0
#: The longest the parent waits for what a run left in its process group to end.
GROUP_END_TIMEOUT_S = 30.0
PR_SET_CHILD_SUBREAPER = 36


def import_time_differences(parent_env: dict[str, str], run_env: dict[str, str]) -> set[str]:
    """The variables that differ between the two and may be read at import."""
    changed = {k for k in parent_env.keys() | run_env.keys() if parent_env.get(k) != run_env.get(k)}
    return {
        k
        for k in changed
        if k not in READ_AT_RUN_TIME
        and k not in SET_BY_VLLM_AT_RUN_TIME
        and not k.startswith(READ_AT_RUN_TIME_PREFIXES)
    }


class EngineForks:
    """One warmed parent process, and the runs forked from it (one at a time)."""

    def __init__(self, env: dict[str, str], warm_imports: tuple[str, ...] = WARM_IMPORTS) -> None:
        self._env = dict(env)
        self._warm_imports = warm_imports
        self._proc: subprocess.Popen[bytes] | None = None
        self._replies: Replies | None = None
        self._lock = threading.Lock()
        self.forked_runs = 0
        self.last_pid: int | None = None
        self.fresh_because: Counter[str] = Counter()

    def _start(self) -> tuple[subprocess.Popen[bytes], Replies]:
        if self._proc is None or self._replies is None or self._proc.poll() is not None:
            self.stop()
            with tempfile.TemporaryFile() as errors:
                proc = subprocess.Popen(
                    [sys.executable, "-m", __name__, *self._warm_imports],
                    env=self._env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=errors,
                    bufsize=0,
                )
                self._proc, self._replies = proc, Replies(proc)
                try:
                    reply = self._replies.next(START_TIMEOUT_S)
                except (RuntimeError, TimeoutError) as e:
                    self.stop()
                    errors.seek(0)
                    tail = errors.read()[-4000:].decode(errors="replace")
                    raise RuntimeError(f"the engine parent did not start: {e}\n{tail}") from None
            if reply.get("ready") is not True:
                self.stop()
                raise RuntimeError(f"the engine parent did not start: {reply}")
        return self._proc, self._replies

    def accepts(self, env: dict[str, str]) -> bool:
        """Whether a run in ``env`` may be forked from this parent (if not, the variables
        that rule it out are counted in :attr:`fresh_because`)."""
        differences = import_time_differences(self._env, env)
        self.fresh_because.update(differences)
        return not differences

    def run(
        self,
        module: str,
        spec_path: Path,
        result_path: Path,
        log_path: Path,
        env: dict[str, str],
        timeout: float,
    ) -> int | None:
        """Fork a run; its exit code, or None if the parent is busy (run it elsewhere).

        Raises :class:`subprocess.TimeoutExpired` after killing the run (its whole
        process group) when it outlives ``timeout``.
        """
        if not self._lock.acquire(blocking=False):
            self.fresh_because["(the parent was busy)"] += 1
            return None
        try:
            proc, replies = self._start()
            argv = [str(spec_path), str(result_path)]
            request = {"module": module, "argv": argv, "log": str(log_path), "env": env, "cwd": os.getcwd()}
            try:
                assert proc.stdin is not None
                proc.stdin.write((json.dumps(request) + "\n").encode())
                pid = self.last_pid = int(replies.next(60.0)["pid"])
                self.forked_runs += 1
                try:
                    return int(replies.next(timeout)["rc"])
                except TimeoutError:
                    held = child_processes.kill_group(pid)
                    replies.next(60.0)  # the parent reaped it
                    child_processes.wait_group_gone(pid, GROUP_END_TIMEOUT_S)
                    child_processes.remove_shared_memory(held)
                    raise subprocess.TimeoutExpired(module, timeout) from None
            except (OSError, RuntimeError, TimeoutError, ValueError, KeyError):
                self.stop()  # out of step with its parent: the next run starts a new one
                raise
        finally:
            self._lock.release()

    def stop(self) -> None:
        """Stop the parent (by its PID); runs already ended with their own."""
        proc, self._proc, self._replies = self._proc, None, None
        if proc is None:
            return
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


class Replies:
    """A process's reply lines, read from its stdout's descriptor into a buffer of our own:
    two lines that arrive together are two replies (a reader's hidden buffer would keep the
    second where ``select`` cannot see it, and its wait would run to the deadline)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self._proc = proc
        self._fd = proc.stdout.fileno()
        self._buffer = b""

    def next(self, timeout: float) -> dict[str, Any]:
        """The next reply, within ``timeout`` (TimeoutError), or an error if the process ended."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply from the engine parent in {timeout} s")
            ready, _, _ = select.select([self._fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self._fd, 65536)
                if not chunk:
                    raise RuntimeError(f"the engine parent exited (rc={self._proc.wait(timeout=10)})")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return dict(json.loads(line))


_FORKS: EngineForks | None = None


def enable(extra_env: dict[str, str]) -> None:
    """Fork this process's engine runs from one warmed parent (started on the first run),
    whose environment is :func:`child_environment` of ``extra_env``."""
    global _FORKS
    if _FORKS is None:
        _FORKS = EngineForks(child_environment(extra_env))


def disable() -> None:
    """Stop the parent; later runs start fresh processes."""
    global _FORKS
    forks, _FORKS = _FORKS, None
    if forks is not None:
        forks.stop()


def summary() -> dict[str, Any]:
    """This process's runs so far: how many were forked, and why others started fresh
    (each variable that ruled a run out, counted; a run may name several)."""
    forks = _FORKS
    if forks is None:
        return {"forked": 0, "fresh_because": {}}
    return {"forked": forks.forked_runs, "fresh_because": dict(forks.fresh_because)}


def summary_line(summaries: list[dict[str, Any]]) -> str:
    """One line for the test report from each process's :func:`summary`."""
    forked = sum(s["forked"] for s in summaries)
    because: Counter[str] = Counter()
    for s in summaries:
        because.update(s["fresh_because"])
    line = f"engine processes: {forked} forked from a parent that imported vLLM"
    if because:
        reasons = ", ".join(f"{k} ({n})" for k, n in because.most_common())
        line += f"; others started fresh because of {reasons}"
    return line


def child_environment(extra: dict[str, str]) -> dict[str, str]:
    """An engine process's environment: :data:`ENGINE_ENV`, this process's over it, then ``extra``."""
    return {**ENGINE_ENV, **os.environ, **extra}


def run_module_forked(
    module: str,
    spec: dict[str, Any],
    *,
    env: dict[str, str],
    timeout: float,
    log_path: str | os.PathLike[str] | None,
) -> dict[str, Any] | None:
    """Like :func:`kvpool.connector.local.engine.run_module` in a forked process; None when
    forks are off, the environment rules them out, or the parent is busy."""
    forks = _FORKS
    full_env = child_environment(env)
    if forks is None or not forks.accepts(full_env):
        return None
    with tempfile.TemporaryDirectory(prefix="kvpool-engine-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        log = Path(log_path) if log_path is not None else Path(tmp) / "engine.log"
        rc = forks.run(module, spec_path, result_path, log, full_env, timeout)
        if rc is None:
            return None
        if rc != 0 or not result_path.exists():
            tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
            raise RuntimeError(f"engine subprocess failed (rc={rc}, forked):\n{tail}")
        return dict(json.loads(result_path.read_text()))


# The parent's side.


def _reply(out: IO[str], message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def _child(request: dict[str, Any]) -> int:
    """In the forked child: the run's process group, output, directory and environment, then the run."""
    os.setpgid(0, 0)
    log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.close(null_fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    import importlib

    module = importlib.import_module(request["module"])
    return int(module.main(request["argv"]))


def _become_subreaper() -> None:
    """Make the orphans of this process's descendants its own children (Linux), so that
    :func:`_end_group` can reap them."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _end_group(pgid: int, timeout: float = GROUP_END_TIMEOUT_S) -> None:
    """Kill what a run left in its process group and reap it (its orphans are this
    subreaper's children), until the group is gone or ``timeout`` passes; then reap any
    other child that has exited."""
    deadline = time.monotonic() + timeout
    held: set[tuple[int, int]] = set()  # what the group held in /dev/shm: a killed engine leaves it
    while time.monotonic() < deadline:
        held |= child_processes.kill_group(pgid)  # its resource trackers end last, their names unlinked
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-pgid, os.WNOHANG)[0] > 0:
                pass
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.01)
    else:
        print(f"process group {pgid} outlived its run by {timeout} s", file=sys.stderr)
    child_processes.remove_shared_memory(held)
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def main(imports: list[str]) -> int:
    """The parent: import ``imports`` (:class:`EngineForks` names :data:`WARM_IMPORTS`), say
    ready, then fork a child per request line until stdin ends."""
    import importlib

    for name in imports:
        importlib.import_module(name)
    _become_subreaper()
    requests, replies = sys.stdin, sys.stdout
    _reply(replies, {"ready": True})
    for line in requests:
        request = json.loads(line)
        replies.flush()
        pid = os.fork()
        if pid == 0:
            return _child(request)
        with contextlib.suppress(OSError):  # as the child does: a kill of the group never misses it
            os.setpgid(pid, pid)
        _reply(replies, {"pid": pid})
        _, status = os.waitpid(pid, 0)
        _end_group(pid)
        _reply(replies, {"rc": os.waitstatus_to_exitcode(status)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
