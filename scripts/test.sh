#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the whole test suite. "No tests ran" is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
status=0
# Test files are spread over one worker per core (pytest-xdist; PYTEST_WORKERS overrides): the
# suite is dominated by single-threaded XLA compiles. A file stays on one worker, so its
# module fixtures (models, servers) are built once.
.venv/bin/python -m pytest -q --durations=25 -n "${PYTEST_WORKERS:-auto}" --dist loadfile "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; treating as a failure" >&2
fi
exit "$status"
