#!/usr/bin/env bash
# Run every check the project has: set-up, lint, then the whole test suite (the end-to-end
# suite on the test node included; `-m "not e2e"` leaves it out).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
