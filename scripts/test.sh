#!/usr/bin/env bash
# Run every check the project has: set-up, lint, type check, then the whole test suite (the
# end-to-end suite on the test node included; `-m "not e2e"` leaves it out). The 20 slowest
# tests are listed at the end of the run, so a test that grows is seen. The type check runs
# beside the tests (its report follows theirs); either failing fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
typecheck_log=$(mktemp)
scripts/typecheck.sh >"$typecheck_log" 2>&1 &
typecheck_pid=$!
trap 'kill "$typecheck_pid" 2>/dev/null || true; rm -f "$typecheck_log"' EXIT
status=0
# Three pytest-xdist workers: much of the suite waits (on processes starting, deadlines, the
# emulated API), so on two cores two workers left a third of the CPU idle (145% of 200%;
# three: 166-174%, the suite 22-33 min instead of 40). Tests that share session fixtures
# across files run whole on one worker (see tests/conftest.py).
# KVPOOL_TEST_WORKERS=0 runs every test in this one process.
workers=${KVPOOL_TEST_WORKERS:-3}
.venv/bin/python -m pytest -n "$workers" --durations=20 "$@" || status=$?
typecheck=0
wait "$typecheck_pid" || typecheck=$?
echo "type check (scripts/typecheck.sh):"
cat "$typecheck_log"
if [ "$typecheck" -ne 0 ]; then
  echo "the type check failed" >&2
  [ "$status" -ne 0 ] || status=$typecheck
fi
exit "$status"
