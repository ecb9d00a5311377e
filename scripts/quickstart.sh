#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the main job: generation on a sample prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/dspark generate "Explain in two sentences why the sky is blue." --max-new-tokens 64 "$@"
