"""A pytest plugin that runs the operator's integration scenarios and records their API requests.

Loaded with ``-p tests.chart.recorder`` into a separate pytest run over ``tests/operator``
(see ``conftest.recorded_requests``). It keeps only the tests that run against the
emulated API server (``cluster`` fixture), and writes every request the operator made in
each of them (with the permissions its body needs besides its verb), as JSON lines, to the
file named by ``KVPOOL_RBAC_RECORD``.

With ``KVPOOL_RBAC_NAMESPACES`` (comma separated) the operator watches only those
namespaces, as the chart runs it in namespaced mode; scenarios that start the operator
some other way than the ``operator`` fixture are left out then.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvpool.operator.rbac import implied_permissions

RECORD_ENV = "KVPOOL_RBAC_RECORD"
NAMESPACES_ENV = "KVPOOL_RBAC_NAMESPACES"
_CLUSTER = pytest.StashKey[object]()


def _namespaces() -> tuple[str, ...]:
    return tuple(ns for ns in os.environ.get(NAMESPACES_ENV, "").split(",") if ns)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def wanted(item: pytest.Item) -> bool:
        fixtures = getattr(item, "fixturenames", ())
        return "cluster" in fixtures and (not _namespaces() or "operator" in fixtures)

    deselected = [item for item in items if not wanted(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if wanted(item)]


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):  # type: ignore[type-arg]
    outcome = yield
    if outcome.excinfo is not None:
        return
    if fixturedef.argname == "operator_config" and _namespaces():
        outcome.get_result()["namespaces"] = _namespaces()
    elif fixturedef.argname == "cluster":
        request.node.stash[_CLUSTER] = outcome.get_result()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    yield
    cluster = item.stash.get(_CLUSTER, None)
    if cluster is None:
        return
    lines = [
        json.dumps(
            {
                "test": item.nodeid,
                "method": r.method.upper(),
                "url": str(r.url),
                # What the API server's admission checks besides the verb (e.g. blockOwnerDeletion).
                "implied": [[p.api_group, p.resource, p.verb] for p in implied_permissions(r.method, r.data)],
            }
        )
        for r in cluster.requests()  # type: ignore[attr-defined]
    ]
    with Path(os.environ[RECORD_ENV]).open("a") as out:
        out.writelines(line + "\n" for line in lines)
