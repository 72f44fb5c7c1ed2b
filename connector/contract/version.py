"""The project's version, read at run time from the installed distribution.

``pyproject.toml`` is its one source; the chart's ``appVersion`` and every
image tag are checked against it.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "mooncake-kvpool"


@cache
def package_version() -> str:
    """The installed ``mooncake-kvpool`` version (``0+unknown`` when run from a bare tree)."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "0+unknown"
