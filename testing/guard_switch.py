"""A test-only switch that turns the connector's payload check off inside server processes.

For a negative control (the chaos run's): a vLLM API server is a process of its own, with its
engine core and worker in processes of their own, so the check cannot be patched from the
test. A server started with :func:`server_env` runs a ``sitecustomize`` (from a folder of its
own on ``PYTHONPATH``) that wraps ``kvpool.connector.worker.staging.payload_matches`` when
that module is imported, in whichever of the server's processes imports it. The wrapper asks
the real check, except while the switch file exists: then every payload "matches" its header,
and a stored object whose payload is not its block's loads as KV. Creating and removing the
file flips the switch at run time. Nothing of this is a product setting; without
:func:`server_env` nothing changes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

SWITCH_ENV = "KVPOOL_TEST_PAYLOAD_CHECK_OFF_WHILE"
TARGET = "kvpool.connector.worker.staging"
REPO_ROOT = Path(__file__).resolve().parent.parent
_SITECUSTOMIZE = "from testing.guard_switch import install\n\ninstall()\n"


def server_env(switch_file: Path, site: Path) -> dict[str, str]:
    """Environment entries for a server whose payload check ``switch_file``'s presence turns off;
    its ``sitecustomize`` is written into the folder ``site`` (the caller's, and removed by it)."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    paths = [str(site), str(REPO_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(paths), SWITCH_ENV: str(switch_file)}


def install() -> None:
    """In a server process (from ``sitecustomize``): wrap the check once its module loads."""
    switch = os.environ.get(SWITCH_ENV)
    if not switch:
        return
    if TARGET in sys.modules:
        _wrap(sys.modules[TARGET], Path(switch))
    else:
        sys.meta_path.insert(0, _WrapOnImport(Path(switch)))


def _wrap(staging: ModuleType, switch: Path) -> None:
    real = staging.payload_matches

    def payload_matches(header: bytes, kind: Any, value: int) -> bool:
        return True if switch.exists() else bool(real(header, kind, value))

    staging.payload_matches = payload_matches  # type: ignore[attr-defined]


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Finds ``TARGET`` as the other finders do, and wraps its check right after it runs."""

    def __init__(self, switch: Path):
        self.switch = switch

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module
        switch = self.switch

        def exec_module(module: ModuleType) -> None:
            run(module)
            _wrap(module, switch)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
