"""Pool transfers run off the core vLLM pins a worker's compute to.

A CPU worker's main thread is bound to its rank's cores (``VLLM_CPU_OMP_THREADS_BIND``)
and spins there between steps; threads it starts inherit the binding. Here the test's
thread is bound to one CPU as vLLM binds it; the real Mooncake client's threads and the
connector's transfer threads it then starts may run on every CPU, and the test's
thread keeps its own binding.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.connector.cpu_affinity import allowed_cpus
from kvpool.connector.pool_client import open_client
from testing.worker import single_group_worker, transfer_threads

pytestmark = [
    pytest.mark.mooncake,
    pytest.mark.skipif(
        not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
        reason="needs thread affinity and at least two CPUs",
    ),
]


def thread_cpus() -> dict[int, set[int]]:
    """Each thread of this process: the CPUs it may run on."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            out[int(task.name)] = os.sched_getaffinity(int(task.name))
        except OSError:  # a thread that ended meanwhile
            continue
    return out


@pytest.fixture
def pinned_thread() -> Iterator[int]:
    """The test's thread bound to one CPU, as vLLM binds a CPU worker's main thread."""
    before = os.sched_getaffinity(0)
    cpu = min(before)
    os.sched_setaffinity(0, {cpu})
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, before)


def test_the_client_and_transfer_threads_are_not_bound_to_the_workers_core(
    pinned_thread, pool_settings, cache_prefix
) -> None:
    everywhere = os.sched_getaffinity(os.getpid()) | allowed_cpus()
    threads_before = set(thread_cpus())

    client = open_client(pool_settings, global_segment_size=0)
    worker = single_group_worker(client, cache_prefix, num_blocks=4)
    try:
        seen: list[set[int]] = []
        done = threading.Event()

        def affinity_in_transfer_thread() -> None:
            seen.append(os.sched_getaffinity(0))
            done.set()

        transfer_threads(worker).submit(affinity_in_transfer_thread).result(timeout=30)
        assert done.is_set()
        new_threads = {tid: cpus for tid, cpus in thread_cpus().items() if tid not in threads_before}
        assert new_threads, "the Mooncake client started threads of its own"
        assert all(len(cpus) > 1 for cpus in new_threads.values()), new_threads
        assert seen == [os.sched_getaffinity(0) | seen[0]] and len(seen[0]) > 1
        assert seen[0] <= everywhere
        # The worker's own thread keeps vLLM's binding.
        assert os.sched_getaffinity(0) == {pinned_thread}
    finally:
        worker.shutdown()
        client.close()


WIDEN_IN_A_THREAD = """
import os, threading
from kvpool.connector.cpu_affinity import unpin_this_thread
seen = []
def in_thread():
    unpin_this_thread()
    seen.append(sorted(os.sched_getaffinity(0)))
thread = threading.Thread(target=in_thread)
thread.start()
thread.join()
print(seen[0])
"""


def test_a_transfer_thread_never_leaves_the_cpus_the_process_was_started_on() -> None:
    """A GPU node pins vLLM to its GPU's NUMA node (``taskset``/``numactl``): widening a
    transfer thread stays inside the mask the process was started with, never the machine."""
    import subprocess
    import sys

    first = min(os.sched_getaffinity(0))
    done = subprocess.run(
        [sys.executable, "-c", WIDEN_IN_A_THREAD],
        preexec_fn=lambda: os.sched_setaffinity(0, {first}),  # as taskset starts a process
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.strip().splitlines()[-1] == str([first])


def test_nothing_is_widened_off_the_cpu_backend(pinned_thread, monkeypatch) -> None:
    """On an accelerator no thread of vLLM's is bound: a transfer thread keeps what it has."""
    from kvpool.connector import cpu_affinity

    monkeypatch.setattr(cpu_affinity, "cpu_backend", lambda: False)
    cpu_affinity.unpin_this_thread()
    assert os.sched_getaffinity(0) == {pinned_thread}
