"""The operator's API requests in its integration scenarios, recorded for the RBAC proof.

The scenarios are the tests of ``tests/operator`` that run the real operator against the
emulated API server (the ``cluster`` fixture). Each request the operator made is kept with
the permissions its body needs besides its verb, as ``{"test", "method", "url", "implied"}``.
Two ways, one format:

* ``SessionRecorder``, registered by ``tests/chart/conftest.py``, notes the requests of every
  scenario the suite's own session runs (cluster-wide, as those tests run the operator), so
  that a whole-suite run does not run the scenarios again for the chart;
* ``ScenarioRun`` runs the scenarios in a pytest of their own with this module as a plugin
  (``-p tests.chart.recorder``): it keeps only the scenarios and writes their requests, as
  JSON lines, to the file named by ``KVPOOL_RBAC_RECORD``. With ``KVPOOL_RBAC_NAMESPACES``
  (comma separated) the operator watches only those namespaces, as the chart runs it in
  namespaced mode; scenarios that start the operator some other way than the ``operator``
  fixture are left out then.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Generator
from pathlib import Path
from typing import IO, Any

import pytest

from kvpool.operator.rbac import implied_permissions

RECORD_ENV = "KVPOOL_RBAC_RECORD"
NAMESPACES_ENV = "KVPOOL_RBAC_NAMESPACES"
ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "tests" / "operator"
_CLUSTER = pytest.StashKey[Any]()


def is_scenario(item: pytest.Item) -> bool:
    """Whether ``item`` is one of the operator's scenarios against the emulated API."""
    return item.path.is_relative_to(SCENARIOS) and "cluster" in getattr(item, "fixturenames", ())


def _requests(item: pytest.Item) -> list[dict[str, Any]]:
    """The operator's requests in ``item``'s emulated cluster (none if it had none)."""
    cluster = item.stash.get(_CLUSTER, None)
    if cluster is None:
        return []
    return [
        {
            "test": item.nodeid,
            "method": r.method.upper(),
            "url": str(r.url),
            # What the API server's admission checks besides the verb (e.g. blockOwnerDeletion).
            "implied": [[p.api_group, p.resource, p.verb] for p in implied_permissions(r.method, r.data)],
        }
        for r in cluster.requests()
    ]


class _Recorder:
    """Keeps each scenario's cluster and hands its requests over once the test is torn down."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(
        self, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
    ) -> Generator[None, Any, None]:
        outcome = yield
        if outcome.excinfo is None:
            self.set_up(fixturedef.argname, request, outcome.get_result())

    def set_up(self, name: str, request: pytest.FixtureRequest, value: Any) -> None:
        if name == "cluster" and is_scenario(request.node):
            request.node.stash[_CLUSTER] = value

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, Any, None]:
        yield
        if is_scenario(item):
            self.keep(_requests(item))
            item.stash[_CLUSTER] = None

    def keep(self, requests: list[dict[str, Any]]) -> None:
        raise NotImplementedError


class SessionRecorder(_Recorder):
    """The requests of the scenarios the suite's own session runs, kept in memory.

    ``complete()``: the session holds every scenario (``tests/operator`` whole, or a folder
    above it, among its arguments, and no scenario deselected).
    """

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.scenarios: list[str] = []  # node ids, in the session's order
        self.failed: list[str] = []
        self._deselected = False
        self._whole = False

    def keep(self, requests: list[dict[str, Any]]) -> None:
        self.requests += requests

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self._deselected = self._deselected or any(is_scenario(i) for i in items)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.scenarios = [item.nodeid for item in session.items if is_scenario(item)]
        self._whole = any(
            "::" not in arg and SCENARIOS.is_relative_to(Path(arg).resolve()) for arg in session.config.args
        )

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed and report.nodeid in self.scenarios and report.nodeid not in self.failed:
            self.failed.append(report.nodeid)

    def complete(self) -> bool:
        return self._whole and not self._deselected and bool(self.scenarios)


class ScenarioRun:
    """The scenarios in a pytest process of their own, recording to a file; started at once."""

    def __init__(self, mode: str, namespaces: tuple[str, ...]):
        self.mode = mode
        self.namespaces = namespaces
        self.folder = Path(tempfile.mkdtemp(prefix=f"kvpool-rbac-{mode}-"))
        self.record = self.folder / "requests.jsonl"
        self.log_path = self.folder / "pytest.log"
        env = dict(os.environ)
        env[RECORD_ENV] = str(self.record)
        env[NAMESPACES_ENV] = ",".join(namespaces)
        env.pop("PYTEST_ADDOPTS", None)
        command = [
            sys.executable, "-m", "pytest", str(SCENARIOS), "-p", "tests.chart.recorder",
            "-p", "no:cacheprovider", "-q", "--no-header",
        ]  # fmt: skip
        self._log: IO[str] = self.log_path.open("w")
        self.process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def requests(self, timeout: float) -> list[dict[str, Any]]:
        """Wait for the run (at most ``timeout`` s); its requests, or AssertionError if it failed."""
        try:
            code = self.process.wait(timeout=timeout)
            output = self.log_path.read_text()
            assert code == 0, f"the operator scenarios failed ({self.mode}):\n{output[-6000:]}"
            return [json.loads(line) for line in self.record.read_text().splitlines()]
        finally:
            self.stop()

    def stop(self) -> None:
        """Kill the run if it still runs (by its PID); remove its files."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


# --- the plugin, in a scenario run's own pytest (``-p tests.chart.recorder``) --------------
def _namespaces() -> tuple[str, ...]:
    return tuple(ns for ns in os.environ.get(NAMESPACES_ENV, "").split(",") if ns)


class _FileRecorder(_Recorder):
    """Keeps only the scenarios; appends their requests to the ``KVPOOL_RBAC_RECORD`` file."""

    def __init__(self, record: Path, namespaces: tuple[str, ...]):
        self.record = record
        self.namespaces = namespaces

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        def wanted(item: pytest.Item) -> bool:
            return is_scenario(item) and (not self.namespaces or "operator" in item.fixturenames)  # type: ignore[attr-defined]

        deselected = [item for item in items if not wanted(item)]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if wanted(item)]

    def set_up(self, name: str, request: pytest.FixtureRequest, value: Any) -> None:
        if name == "operator_config" and self.namespaces:
            value["namespaces"] = self.namespaces
        super().set_up(name, request, value)

    def keep(self, requests: list[dict[str, Any]]) -> None:
        with self.record.open("a") as out:
            out.writelines(json.dumps(r) + "\n" for r in requests)


def pytest_configure(config: pytest.Config) -> None:
    if RECORD_ENV in os.environ:
        config.pluginmanager.register(_FileRecorder(Path(os.environ[RECORD_ENV]), _namespaces()))
