#!/usr/bin/env bash
# Sets everything up and runs the whole test suite (FEDLANG_FAST=1 skips tests marked slow).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh dev
.venv/bin/ruff check src tests examples bench
.venv/bin/mypy
if [ "${FEDLANG_FAST:-0}" = "1" ]; then
  .venv/bin/python -m pytest -q -m "not slow" "$@"
else
  .venv/bin/python -m pytest -q "$@"
fi
