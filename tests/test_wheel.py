"""The wheel ships the product only: no test scaffolding, nothing that imports it.

The wheel is built from a copy of the source tree with ``testing/``, ``tests/`` and
``benchmarks/`` beside the product, as a developer's checkout has them, so leaving them out
is the project's packaging doing it, not an absent folder.
"""

from __future__ import annotations

import re
import shutil
import zipfile
from pathlib import Path

import pytest

from tests.images.replay import pip_wheel

REPO = Path(__file__).resolve().parents[1]
#: What the copy holds: the product, and the folders that must stay out of the wheel.
SOURCES = (
    "pyproject.toml",
    "README.md",
    "LICENSE",
    "connector",
    "operator",
    "testing",
    "tests",
    "benchmarks",
)
#: Every module of ``kvpool.connector.local``: the product commands and what the demo runs.
LOCAL_MODULES = {
    "__init__",
    "demo",
    "disk_tier",
    "engine",
    "layout_command",
    "layout_probe",
    "pool",
    "pool_command",
    "ports",
    "process_group",
    "recording",
    "stopping",
    "supervised",
    "tenant_quotas",
    "tiny_model",
    "watchdog",
}
IMPORTS_SCAFFOLDING = re.compile(r"^\s*(from|import)\s+(testing|tests|benchmarks)\b", re.MULTILINE)


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Every file of the wheel built from a copy of this checkout, by its path in the wheel."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    for name in SOURCES:
        origin = REPO / name
        if origin.is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".models")
            shutil.copytree(origin, src / name, ignore=ignore)
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(origin, src / name)
    wheel = pip_wheel(src, root / "wheels")
    with zipfile.ZipFile(wheel) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def test_the_wheel_holds_only_the_kvpool_package(wheel_files: dict[str, bytes]) -> None:
    tops = {name.split("/", 1)[0] for name in wheel_files}
    metadata = {top for top in tops if top.startswith("mooncake_kvpool-") and top.endswith(".dist-info")}
    assert len(metadata) == 1 and tops - metadata == {"kvpool"}, tops


def test_no_test_scaffolding_ships(wheel_files: dict[str, bytes]) -> None:
    local = {Path(name).stem for name in wheel_files if name.startswith("kvpool/connector/local/")}
    assert local == LOCAL_MODULES
    assert not [name for name in wheel_files if re.search(r"(^|/)(testing|tests|support|conftest)\b", name)]


def test_no_shipped_module_imports_test_scaffolding(wheel_files: dict[str, bytes]) -> None:
    offenders = [
        name
        for name, body in wheel_files.items()
        if name.endswith(".py") and IMPORTS_SCAFFOLDING.search(body.decode())
    ]
    assert not offenders


def test_every_command_is_in_the_wheel(wheel_files: dict[str, bytes]) -> None:
    (entry_points,) = [body for name, body in wheel_files.items() if name.endswith("entry_points.txt")]
    targets = re.findall(r"=\s*([\w.]+):", entry_points.decode())
    assert len(targets) == 4
    for module in targets:
        assert module.replace(".", "/") + ".py" in wheel_files, module
