#!/usr/bin/env bash
# Run every check the project has: set-up, lint, type check, then the whole test suite (the
# end-to-end suite on the test node included; `-m "not e2e"` leaves it out). The 20 slowest
# tests are listed at the end of the run, so a test that grows is seen.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
scripts/typecheck.sh
exec .venv/bin/python -m pytest --durations=20 "$@"
