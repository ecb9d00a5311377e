#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the main job: speculative generation on a sample prompt
# (prompt-lookup drafter; output identical to plain greedy decoding).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/dspark generate "Repeat this list with one item per line: apples, bananas, cherries, dates, figs." \
    --max-new-tokens 64 --drafter ngram "$@"
