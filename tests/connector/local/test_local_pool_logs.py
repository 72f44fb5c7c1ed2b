"""A local pool's log folders: gone after a clean stop, kept where they explain something."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from kvpool.connector.local.pool import LocalPool, MooncakeMaster, MooncakeStore, free_port, kill_process

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


def test_a_master_that_exits_before_listening_says_why_even_once_its_log_is_gone() -> None:
    """A test pool removes its log folders when it stops: the error carries the log's end."""
    master = MooncakeMaster(extra_args=("--no_such_flag=1",))
    try:
        with pytest.raises(RuntimeError, match="before listening") as failed:
            master.start(30)
    finally:
        master.stop()
        shutil.rmtree(master.log_dir, ignore_errors=True)
    assert "no_such_flag" in str(failed.value), str(failed.value)


def test_a_master_that_does_not_serve_in_time_is_stopped() -> None:
    """``kvpool-local-pool`` reported "did not start" and left the master running on its own."""
    master = MooncakeMaster()
    try:
        with pytest.raises(TimeoutError):
            master.start(timeout=0)  # no time to listen
        assert master.process is not None
        assert master.process.poll() is not None  # stopped, and reaped
    finally:
        kill_process(master.process)
        shutil.rmtree(master.log_dir, ignore_errors=True)


def test_a_store_that_does_not_listen_in_time_names_its_log() -> None:
    """Its folder used to stay in the temp folder, named by no message."""
    store = MooncakeStore(f"127.0.0.1:{free_port()}", "32MB")
    try:
        with pytest.raises(TimeoutError) as failed:
            store.start(timeout=0)  # no time to listen
        assert store.process is not None and store.process.poll() is not None  # stopped, and reaped
    finally:
        kill_process(store.process)
        shutil.rmtree(store.log_dir, ignore_errors=True)
    assert f"the end of {store.log_dir / 'store.log'}" in str(failed.value)


def test_a_pool_whose_store_fails_keeps_only_the_log_its_error_names() -> None:
    """The master's log folder used to stay too, named by nothing."""
    pool = LocalPool(segment_size="15MB")  # less than Mooncake's store mounts: it exits
    with pytest.raises(RuntimeError, match="before listening") as failed:
        pool.start()
    named = re.search(r"the end of (\S+)/store\.log:", str(failed.value))
    try:
        assert named, str(failed.value)
        assert pool.master is not None
        assert not pool.master.log_dir.exists()
        assert Path(named.group(1), "store.log").exists()
    finally:
        if named:
            shutil.rmtree(named.group(1), ignore_errors=True)
        if pool.master is not None:
            shutil.rmtree(pool.master.log_dir, ignore_errors=True)
