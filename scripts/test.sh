#!/usr/bin/env bash
# Run every check the project has: set-up, lint, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
# The end-to-end suite (tests/e2e, marker e2e) runs only with KVPOOL_E2E=1 until it
# has been proven green on a quiet machine: it starts whole pools of processes.
if [ "${KVPOOL_E2E:-0}" = "1" ]; then
  exec .venv/bin/python -m pytest "$@"
fi
exec .venv/bin/python -m pytest -m "not e2e" "$@"
