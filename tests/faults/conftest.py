"""Fixtures of the fault suite: one tiny hybrid model, and every reference output computed once.

References come from a real engine without any connector whose prefix cache is emptied
before each request, i.e. a full prefill of every prompt: what a correct pool must match.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.faults.helpers import UNIVERSE, Engine

SOAK_ENV = "KVPOOL_SOAK"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"soak: minutes-long soak of the fault suite (runs only with {SOAK_ENV}=1)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(SOAK_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"soak: set {SOAK_ENV}=1 to run it")
    for item in items:
        if item.get_closest_marker("soak") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from testing.models import build_gemma3

    return build_gemma3(tmp_path_factory.mktemp("faults-gemma3"))


@pytest.fixture(scope="session")
def references(gemma_dir: Path) -> dict[tuple[int, int], list[int]]:
    """Output of every prompt of the suite, without a pool (created before any pooled engine)."""
    engine = Engine(gemma_dir, None)
    try:
        return {key: engine.serve(key).tokens for key in UNIVERSE}
    finally:
        engine.close()
