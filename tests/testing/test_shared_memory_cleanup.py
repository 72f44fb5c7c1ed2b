"""A SIGKILLed process group leaves its ``multiprocessing`` names in ``/dev/shm`` (vLLM's
message queues, ``psm_*``, and ``sem.mp-*`` semaphores): :func:`kill_group` notes those the
group holds, and :func:`remove_shared_memory` unlinks exactly those once it is gone."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from multiprocessing import shared_memory

import pytest

from kvpool.connector.local.process_group import end_group
from testing.child_processes import kill_group, remove_shared_memory, wait_group_gone
from testing.node.kubelet import stop_process

#: A group like an engine's: a process that creates a SharedMemory segment and a named
#: semaphore (spawn's: kept under its name until its finalizer or resource tracker unlinks
#: it), a child that maps the segment too, and the resource tracker, which does not keep
#: these two (as it keeps none of the names vLLM's processes open by name): only what the
#: group maps names them.
HOLDER = """
import multiprocessing, sys, time
from multiprocessing import resource_tracker, shared_memory
segment = shared_memory.SharedMemory(create=True, size=1 << 20)
lock = multiprocessing.get_context("spawn").Lock()
resource_tracker.unregister(segment._name, "shared_memory")
resource_tracker.unregister(lock._semlock.name, "semaphore")
if __name__ == "__main__":
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(300,))
    child.start()
    print(segment.name, lock._semlock.name, flush=True)
    time.sleep(300)
"""


def _start_holder() -> tuple[subprocess.Popen[str], list[str]]:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert process.stdout is not None
    segment, semaphore = process.stdout.readline().split()
    return process, [f"/dev/shm/{segment.lstrip('/')}", f"/dev/shm/sem.{semaphore.lstrip('/')}"]


def test_a_killed_groups_shared_memory_is_removed_and_nothing_else() -> None:
    ours = shared_memory.SharedMemory(create=True, size=4096)  # held here: it stays
    process, paths = _start_holder()
    try:
        assert all(os.path.exists(path) for path in paths), paths
        held = kill_group(process.pid)
        process.wait(30)
        assert wait_group_gone(process.pid)
        removed = remove_shared_memory(held)
        assert not any(os.path.exists(path) for path in paths), "the killed group's names are gone"
        assert sorted(removed) == sorted(paths)
        assert os.path.exists(f"/dev/shm/{ours.name.lstrip('/')}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
        for path in paths:  # a failed run leaves nothing either
            if os.path.exists(path):
                os.unlink(path)
        ours.close()
        ours.unlink()


#: A group like a vLLM server after its own shutdown SIGKILLed a lingering worker: the
#: worker's semaphore (registered with the leader's resource tracker, mapped by no one now)
#: waits for the tracker, which unlinks it once the leader, its last user, is gone.
WORKER = """
import multiprocessing, time
lock = multiprocessing.get_context("spawn").Lock()
conn.send(lock._semlock.name)
time.sleep(300)
"""
LEADER = f"""
import multiprocessing, os, signal, time
if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # it lingers past any grace: a SIGKILL ends it
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    worker = ctx.Process(target=exec, args=({WORKER!r}, {{"conn": theirs}}))
    worker.start()
    name = ours.recv()
    os.kill(worker.pid, signal.SIGKILL)
    worker.join()
    print(name, flush=True)
    time.sleep(300)
"""


def _stop_by_kill_group(process: subprocess.Popen[bytes]) -> None:
    held = kill_group(process.pid)
    process.wait(30)
    assert wait_group_gone(process.pid)
    remove_shared_memory(held)


def _stop_as_a_pod(process: subprocess.Popen[bytes]) -> None:
    assert asyncio.run(stop_process(process, grace=0.5)) == -signal.SIGKILL


def _stop_as_an_engine(process: subprocess.Popen[bytes]) -> None:
    """As ``kvpool-demo`` ends its engine's group (``supervised.run_in_own_group``)."""
    assert end_group(process.pid, grace_s=0.5)
    process.wait(30)


@pytest.mark.parametrize(
    "stop", [_stop_by_kill_group, _stop_as_a_pod, _stop_as_an_engine], ids=["kill_group", "pod", "engine"]
)
def test_a_killed_groups_resource_tracker_unlinks_what_a_worker_killed_before_left(
    stop: Callable[[subprocess.Popen[bytes]], None],
) -> None:
    process = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, start_new_session=True)
    assert process.stdout is not None
    path = f"/dev/shm/sem.{process.stdout.readline().decode().strip().lstrip('/')}"
    try:
        assert os.path.exists(path), "the killed worker's semaphore waits for its tracker"
        stop(process)
        assert not os.path.exists(path), "the group's tracker unlinked it before it ended"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
        if os.path.exists(path):
            os.unlink(path)


def test_a_name_still_mapped_elsewhere_or_taken_since_stays() -> None:
    ours = shared_memory.SharedMemory(create=True, size=4096)
    path = f"/dev/shm/{ours.name.lstrip('/')}"
    try:
        st = os.stat(path)
        assert remove_shared_memory({(st.st_dev, st.st_ino)}) == []  # this process maps it
        assert os.path.exists(path)
    finally:
        ours.close()
        ours.unlink()
