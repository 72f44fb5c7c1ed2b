"""The watchdog of a pool's processes: it ends them with their starter, not with the starting thread.

That a SIGKILLed ``kvpool-local-pool`` takes its master and store with it is
``tests/connector/local/test_local_pool_command.py``.
"""

from __future__ import annotations

import threading

import pytest

from kvpool.connector.local.pool import LocalPool, port_open
from testing.child_processes import running

pytestmark = pytest.mark.mooncake


def test_a_pool_started_by_a_thread_outlives_the_thread() -> None:
    """Tests and benchmarks start pools from other threads: ``PR_SET_PDEATHSIG`` would have
    killed the master and the store as soon as the starting thread ended."""
    pool = LocalPool(segment_size="32MB")
    starter = threading.Thread(target=pool.start)
    starter.start()
    starter.join()
    try:
        assert pool.master is not None and pool.store is not None
        assert pool.exited() == []
        assert port_open(pool.master.rpc_port)
        assert pool.master.capacity_bytes() > 0  # the store's memory is still mounted
    finally:
        pool.stop()
    assert pool.master.process is not None and pool.store.process is not None
    assert not running(pool.master.process.pid) and not running(pool.store.process.pid)
