"""Pool transfers off the cores vLLM pins its compute to.

vLLM's CPU workers bind their OpenMP threads, the main thread among them, to a
set of cores (``VLLM_CPU_OMP_THREADS_BIND``), one set per rank; every thread a
worker starts later inherits that binding. Between steps the main thread spins
on vLLM's shared-memory queue. A Mooncake client created there, and transfer
threads started there, would share that one spinning core with it: under load
their calls then make no progress for seconds, loads pass their deadline and
requests recompute. So on the CPU backend the client's threads and the connector's
transfer threads are started with the process's own mask (the union of its threads'
masks: never wider than ``taskset``, ``numactl`` or the cpuset gave the process); the
forward keeps its own binding. On an accelerator nothing is widened: a worker pinned to
its GPU's NUMA node keeps every thread there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from kvpool.connector.observability.logs import get_logger

logger = get_logger(__name__)


def cpu_backend() -> bool:
    """Whether vLLM runs on its CPU backend here, the one whose workers bind their threads."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # no vLLM (tools, tests of the contract): nothing binds threads
        return False


def allowed_cpus() -> set[int]:
    """The widest mask a thread of this process holds: the process's own mask (threads that
    predate vLLM's binding keep it), never wider than what the process was started with
    (``taskset``/``numactl``, the container's cpuset)."""
    cpus: set[int] = set()
    for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ():
        try:
            cpus |= os.sched_getaffinity(int(task))
        except OSError:  # a thread that ended meanwhile
            continue
    return cpus or os.sched_getaffinity(0)


def unpin_this_thread() -> None:
    """On vLLM's CPU backend, let the calling thread run on every CPU of this process's own
    mask; elsewhere (accelerators: no thread of vLLM's is bound) leave it as it is."""
    if not hasattr(os, "sched_setaffinity") or not cpu_backend():
        return
    try:
        os.sched_setaffinity(0, allowed_cpus())
    except OSError:  # a cpuset that refuses: keep the inherited binding
        logger.debug("could not widen the CPU affinity of a transfer thread", exc_info=True)


@contextmanager
def unpinned() -> Iterator[None]:
    """The calling thread on any allowed CPU for the block (threads started in it inherit that),
    its own binding restored afterwards."""
    if not hasattr(os, "sched_getaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    unpin_this_thread()
    try:
        yield
    finally:
        try:
            os.sched_setaffinity(0, before)
        except OSError:
            logger.debug("could not restore the CPU affinity", exc_info=True)
