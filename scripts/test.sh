#!/usr/bin/env bash
# Install, then run the whole test suite (CPU only; GPU tests skip with a reason).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/python -m pytest -q -n 2 --dist loadfile -p no:cacheprovider "$@"
