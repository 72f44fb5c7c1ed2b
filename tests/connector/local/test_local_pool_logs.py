"""A local pool's log folders: gone after a clean stop, kept where they explain something."""

from __future__ import annotations

import shutil

import pytest

from kvpool.connector.local.pool import LocalPool, kill_process

pytestmark = pytest.mark.mooncake


def test_a_clean_stop_leaves_no_log_folders() -> None:
    """Each pool used to leave its master's and its store's log folder in /tmp (hundreds a
    day from the tests and benchmarks alone)."""
    with LocalPool(segment_size="64MB") as pool:
        assert pool.master is not None and pool.store is not None
        folders = [pool.master.log_dir, pool.store.log_dir]
        assert all((folder / name).exists() for folder, name in zip(folders, ("master.log", "store.log")))
    assert not any(folder.exists() for folder in folders)
    pool.stop()  # stopping again changes nothing


def test_logs_are_kept_when_asked_or_when_a_part_died_on_its_own() -> None:
    kept = LocalPool(segment_size="64MB", keep_logs=True).start()
    kept.stop()
    assert kept.master is not None and kept.store is not None
    assert (kept.master.log_dir / "master.log").exists() and (kept.store.log_dir / "store.log").exists()

    crashed = LocalPool(segment_size="64MB").start()
    assert crashed.master is not None and crashed.store is not None
    kill_process(crashed.store.process)  # the store dies before the pool is stopped
    crashed.stop()
    assert (crashed.store.log_dir / "store.log").exists(), "its log says why it died"
    assert (crashed.master.log_dir / "master.log").exists()

    for pool in (kept, crashed):
        assert pool.master is not None and pool.store is not None
        shutil.rmtree(pool.master.log_dir, ignore_errors=True)
        shutil.rmtree(pool.store.log_dir, ignore_errors=True)
