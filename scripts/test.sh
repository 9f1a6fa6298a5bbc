#!/usr/bin/env bash
# Sets everything up and runs the test suite: ruff, mypy and every test not marked slow
# (pytest: 11 minutes on 2 cores, tests/DURATIONS.md). FEDLANG_SLOW=1 runs the slow tests too
# (end-to-end runs with many processes, accuracy targets); .ci/run does.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh dev
# onnxruntime-web (npm) and, as root without /usr/bin/chromium, Debian's chromium
# (apt-get, a system package) for the browser tests; FEDLANG_BROWSER_SETUP=0 installs
# neither. Where they cannot be had, the browser tests are skipped, saying why.
./scripts/browser_setup.sh
./scripts/proxy_setup.sh  # Debian's nginx (apt-get, as root) for test_proxy.py; FEDLANG_PROXY_SETUP=0: none
.venv/bin/ruff check src tests examples bench
.venv/bin/mypy
# One pytest-xdist worker per core, at most 4 (each holds a JAX, a Ray instance and a
# PostgreSQL cluster once it needs them), FEDLANG_TEST_WORKERS to choose; a test file
# stays on one worker, so its fixtures and compiled programs serve all its tests. The 30
# slowest tests are printed at the end (tests/DURATIONS.md keeps a dated copy), and the
# whole output is kept in build/test-output.txt.
CORES=$(nproc 2>/dev/null || echo 2)
WORKERS=${FEDLANG_TEST_WORKERS:-$(( CORES < 4 ? CORES : 4 ))}
MARKS=(-m "not slow")
if [ "${FEDLANG_SLOW:-0}" = "1" ]; then
  MARKS=()
fi
mkdir -p build
.venv/bin/python -m pytest -q "${MARKS[@]}" -n "$WORKERS" --dist loadfile --durations=30 "$@" \
  | tee build/test-output.txt
