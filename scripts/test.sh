#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the whole test suite. "No tests ran" is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
status=0
.venv/bin/python -m pytest -q --durations=25 "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; treating as a failure" >&2
fi
exit "$status"
