#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the main job: speculative generation on a sample prompt with
# the trained DSpark drafter shipped in the package and DSpark's load-aware scheduler (output
# identical to plain greedy decoding), timed against plain generation of the same prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/dspark generate "Write a Python function that returns the n-th Fibonacci number." \
    --max-new-tokens 64 --drafter smollm2-135m-dspark --policy dspark --compare-plain "$@"
