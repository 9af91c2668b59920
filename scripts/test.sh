#!/usr/bin/env bash
# Install, then run the whole test suite (CPU only; GPU tests skip with a reason).
# The Triton kernel tests run in their own pytest process: their conftest turns on
# TRITON_INTERPRET=1 for the whole process, and triton 3.9's interpreter leaves
# triton.language patched after a run, which would leak into other tests' workers.
# --no-loadscope-reorder: workers take whole files in collection order, which tests/conftest.py
# sorts longest first; xdist's own order (most tests first) left a long file running alone at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -p no:cacheprovider --ignore=tests/backends/triton "$@"
.venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -p no:cacheprovider tests/backends/triton "$@"
