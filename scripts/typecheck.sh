#!/usr/bin/env bash
# mypy over kvpool.connector, kvpool.operator and dashboards/ (configuration: [tool.mypy] in
# pyproject.toml). setuptools maps the folders connector/ and operator/ to kvpool.connector and
# kvpool.operator; mypy finds them by those names through links under .cache/mypy-src/kvpool/.
set -euo pipefail
cd "$(dirname "$0")/.."
links=.cache/mypy-src/kvpool
mkdir -p "$links"
ln -sfn ../../../connector "$links/connector"
ln -sfn ../../../operator "$links/operator"
exec .venv/bin/mypy "$@"
