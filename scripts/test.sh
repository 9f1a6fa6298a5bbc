#!/usr/bin/env bash
# Sets everything up and runs the test suite: ruff, mypy and every test not marked slow
# (well under 20 minutes on 2 cores). FEDLANG_SLOW=1 runs the slow tests too (end-to-end
# runs with many processes, accuracy targets); .ci/run does.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh dev
# onnxruntime-web (npm) and, as root without /usr/bin/chromium, Debian's chromium
# (apt-get, a system package) for the browser tests; FEDLANG_BROWSER_SETUP=0 installs
# neither. Where they cannot be had, the browser tests are skipped, saying why.
./scripts/browser_setup.sh
.venv/bin/ruff check src tests examples bench
.venv/bin/mypy
if [ "${FEDLANG_SLOW:-0}" = "1" ]; then
  .venv/bin/python -m pytest -q "$@"
else
  .venv/bin/python -m pytest -q -m "not slow" "$@"
fi
