#!/usr/bin/env bash
# Sets up what the browser client tests need, each step saying why when it cannot run
# (the tests then skip with that reason):
#   1. onnxruntime-web's files, fetched with npm into the Python package
#      (python -m fedlang.deploy.browser.assets; checked against pinned SHA-256s);
#   2. Debian's Chromium at /usr/bin/chromium, installed with apt-get when missing (as root).
# Output goes to build/browser_setup.log as well.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
LOG=build/browser_setup.log
PY=${FEDLANG_PYTHON:-.venv/bin/python}
: > "$LOG"
say() { echo "browser setup: $*" | tee -a "$LOG" >&2; }

if ! "$PY" -m fedlang.deploy.browser.assets >>"$LOG" 2>&1; then
  say "onnxruntime-web could not be installed (see $LOG); the browser tests will be skipped."
fi

if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Debian's chromium with apt-get..."
    if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } >>"$LOG" 2>&1; then
      say "apt-get could not install chromium (see $LOG); the browser tests will be skipped."
    fi
  else
    say "Chromium is missing and cannot be installed here (apt-get as root is needed); the browser tests will be skipped."
  fi
fi
exit 0
