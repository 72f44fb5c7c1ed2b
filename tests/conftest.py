"""Shared fixtures: real services on free loopback ports, always stopped."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvpool.connector.local.ports import held_port, release_port
from testing import engine_forks
from testing.engine import apply_engine_env, fork_engine_runs, stop_forking_engine_runs
from testing.private_temp import use_private_temp_folder

# Before any test imports vLLM: a CPU engine in this process, no hub access.
apply_engine_env()
# What vLLM leaves in the temporary folder, in a folder of this run's own removed at exit.
use_private_temp_folder()
# vLLM may hash blocks with Python's hash(): every engine process of a run must agree.
os.environ.setdefault("PYTHONHASHSEED", "0")


def pytest_configure(config: pytest.Config) -> None:
    """Engine processes fork from one parent that has imported vLLM (about 9 s saved on each
    of the suite's many; ``KVPOOL_TEST_FRESH_ENGINES=1`` starts each one fresh instead)."""
    if os.environ.get("KVPOOL_TEST_FRESH_ENGINES") != "1":
        fork_engine_runs()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop the engines' parent (by its PID)."""
    stop_forking_engine_runs()


#: Each process's count of forked and fresh engine runs (this one's, and each xdist worker's).
_ENGINE_RUNS: list[dict[str, Any]] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker hands its engine runs' count to the controller; a lone run keeps it."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["engine_runs"] = engine_forks.summary()
    else:
        _ENGINE_RUNS.append(engine_forks.summary())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """The controller collects each worker's engine runs."""
    runs = getattr(node, "workeroutput", {}).get("engine_runs")
    if runs is not None:
        _ENGINE_RUNS.append(runs)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """How many engine processes were forked, and what made the others start fresh."""
    if any(runs["forked"] or runs["fresh_because"] for runs in _ENGINE_RUNS):
        terminalreporter.write_line(engine_forks.summary_line(_ENGINE_RUNS))


@pytest.fixture(scope="session")
def local_pool() -> Iterator[object]:
    """A real Mooncake master and store process on loopback for the session."""
    from kvpool.connector.local.pool import LocalPool

    with LocalPool(segment_size="512MB") as pool:
        yield pool


@pytest.fixture
def cache_prefix() -> str:
    """A key namespace of its own for each test."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def pool_settings(local_pool, cache_prefix):
    from kvpool.connector.contract.settings import ConnectorSettings

    return ConnectorSettings.parse(
        {"master_server_address": local_pool.address, "cache_prefix": cache_prefix}
    )


@pytest.fixture
def pool_client(pool_settings) -> Iterator[object]:
    """A store client with no memory of its own (the store process holds it)."""
    from kvpool.connector.pool_client import open_client

    client = open_client(pool_settings, global_segment_size=0)
    yield client
    client.close()


#: Folders whose tests share session fixtures across files (one cluster, one set of
#: reference outputs, the operator's recorded requests read by the chart's RBAC tests):
#: under ``pytest -n`` each runs whole on one worker. Any other file is a group of its own.
SHARED_GROUPS = {"e2e": "e2e", "faults": "faults", "operator": "operator", "chart": "operator"}
#: These groups go first, longest first (as measured in a full run on 2 cores, 3 workers:
#: faults ~1220 s, e2e ~960, the short chaos run ~600, operator ~600, the benchmarks' smoke
#: ~540, ...), so that the workers finish together; every other group follows in collection
#: order.
GROUP_ORDER = (
    "faults",
    "e2e",
    "chaos/test_chaos_short.py",
    "operator",
    "test_benchmarks_smoke.py",
    "connector/test_engine_pool.py",
    "connector/test_replicated_kv.py",
    "connector/test_tensor_parallel.py",
    "connector/integrity/test_layout_whole_path.py",
    "connector/test_mixed_fleet.py",
    "dashboards/test_live.py",
)


def share_group(nodeid: str) -> str:
    """The group of a test (by node id: ``tests/<folder>/<file>::<name>``): its shared
    folder's, or its file's."""
    path = nodeid.split("::", 1)[0].removeprefix("tests/")
    return SHARED_GROUPS.get(path.split("/", 1)[0], path)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The shared groups first (a stable sort: each group keeps its order)."""

    def rank(item: pytest.Item) -> int:
        group = share_group(item.nodeid)
        return GROUP_ORDER.index(group) if group in GROUP_ORDER else len(GROUP_ORDER)

    items.sort(key=rank)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``pytest -n``: each group runs whole on one worker, in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return share_group(nodeid)

    config.option.loadscopereorder = False  # keep the order above, not the most tests first
    return SharedFixtureScheduling(config, log)


@pytest.fixture
def held_ports() -> Iterator[Callable[[], int]]:
    """Draws loopback ports held (:func:`held_port`) until the test ends: for servers it starts
    only later (or again), which another test process's server could otherwise take first."""
    drawn: list[int] = []

    def draw() -> int:
        drawn.append(held_port())
        return drawn[-1]

    yield draw
    release_port(*drawn)
