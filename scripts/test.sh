#!/usr/bin/env bash
# Sets everything up and runs the test suite (slow tests too when FEDLANG_SLOW=1).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh dev
.venv/bin/ruff check src tests examples
.venv/bin/python -m pytest -q "$@"
