#!/usr/bin/env bash
# The main job: install, then compile the built-in ~156M Llama with graphopt, check it
# against eager and print the speed table. Extra arguments go to `graphopt run`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/graphopt run llama-small --seq-len 128 "$@"
