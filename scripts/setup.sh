#!/usr/bin/env bash
# Creates .venv (if missing) and installs fedlang with the given extras, e.g. `dev`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[${1:-dev}]"
