"""Pool transfers off the cores vLLM pins its compute to.

vLLM's CPU workers bind their OpenMP threads, the main thread among them, to a
set of cores (``VLLM_CPU_OMP_THREADS_BIND``), one set per rank; every thread a
worker starts later inherits that binding. Between steps the main thread spins
on vLLM's shared-memory queue. A Mooncake client created there, and transfer
threads started there, would share that one spinning core with it: under load
their calls then make no progress for seconds, loads pass their deadline and
requests recompute. So the client's threads and the connector's transfer threads
are started with the affinity of the whole process's allowed CPUs (the kernel
narrows it to the container's cpuset); the forward keeps its own binding.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from kvpool.connector.logs import get_logger

logger = get_logger(__name__)


def allowed_cpus() -> set[int]:
    """Every CPU the machine has; the kernel keeps only those of this process's cpuset."""
    return set(range(os.cpu_count() or 1))


def unpin_this_thread() -> None:
    """Let the calling thread run on any allowed CPU (a no-op where affinity is not supported)."""
    if not hasattr(os, "sched_setaffinity"):
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
