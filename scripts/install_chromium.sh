#!/usr/bin/env bash
# Debian's Chromium, for the browser test of `graphopt debug --report`
# (tests/debug/test_report.py renders the page headless and checks the DOM and a screenshot).
# Installs only where it is missing and either CI=true or this runs as root; never fails the
# install: without Chromium that one test skips locally (and fails under CI=true, saying why).
set -uo pipefail

if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  exit 0
fi
if [ "${CI:-}" != "true" ] && [ "$(id -u)" != "0" ]; then
  echo "install_chromium.sh: Chromium is missing; the report's browser test will skip (install: sudo apt-get install chromium)" >&2
  exit 0
fi
SUDO=()
if [ "$(id -u)" != "0" ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
  else
    echo "install_chromium.sh: not root and no passwordless sudo: cannot install Chromium; the report's browser test will not run" >&2
    exit 0
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_chromium.sh: apt-get is not available: install Chromium another way for the report's browser test" >&2
  exit 0
fi
log=$(mktemp)
if "${SUDO[@]}" apt-get update -qq >"$log" 2>&1 \
   && DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends chromium >>"$log" 2>&1; then
  echo "install_chromium.sh: installed $(chromium --version 2>/dev/null || echo chromium)" >&2
else
  echo "install_chromium.sh: apt-get could not install chromium (last lines below); the report's browser test will not run" >&2
  tail -n 5 "$log" >&2
fi
rm -f "$log"
exit 0
