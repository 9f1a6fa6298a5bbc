#!/usr/bin/env bash
# Sets up what the browser client tests need, each step saying why when it cannot run
# (the tests then skip with that reason) and never failing:
#   1. the npm packages the server serves (onnxruntime-web for browser clients, uPlot
#      for the dashboard), downloaded from npm's registry into the Python package
#      (python -m fedlang.deploy.assets; no npm needed; checked against pinned
#      SHA-256s; a wheel gets them at build time, see setup.py);
#   2. Debian's Chromium at /usr/bin/chromium, installed with apt-get when missing (as
#      root, without its recommended packages: avahi, cups and the like are 160 of
#      the 400 packages it would pull into an empty system): a change to the system,
#      which the README's test command states.
# FEDLANG_BROWSER_SETUP=0 installs nothing (the tests use what is already there).
# Without a network each step gives up within about a minute.
# Output goes to build/browser_setup.log as well.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
LOG=build/browser_setup.log
PY=${FEDLANG_PYTHON:-.venv/bin/python}
# Where the tests look for Chromium; another path only to test this script.
CHROMIUM=${FEDLANG_CHROMIUM:-/usr/bin/chromium}
: > "$LOG"
say() { echo "browser setup: $*" | tee -a "$LOG" >&2; }

if [ "${FEDLANG_BROWSER_SETUP:-1}" = 0 ]; then
  say "FEDLANG_BROWSER_SETUP=0: installing nothing (no npm, no apt-get); the browser tests that need onnxruntime-web or Chromium will be skipped where they are missing."
  exit 0
fi

# npm gives up soon without a network (its defaults retry for minutes)
if ! npm_config_fetch_retries=1 npm_config_fetch_retry_maxtimeout=10000 \
     npm_config_fetch_timeout=30000 "$PY" -m fedlang.deploy.assets >>"$LOG" 2>&1; then
  say "onnxruntime-web or uPlot could not be installed (npm missing or no network? see $LOG); the browser and dashboard tests will be skipped."
fi

if [ ! -x "$CHROMIUM" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Debian's chromium with apt-get (a system package; FEDLANG_BROWSER_SETUP=0 skips this)..."
    APT=(-q -o Acquire::Retries=0 -o Acquire::http::Timeout=20 -o Acquire::https::Timeout=20)
    if ! { apt-get "${APT[@]}" update && DEBIAN_FRONTEND=noninteractive apt-get "${APT[@]}" install -y --no-install-recommends chromium; } >>"$LOG" 2>&1; then
      say "apt-get could not install chromium (no network? see $LOG); the browser tests will be skipped."
    fi
  else
    say "Chromium is missing and cannot be installed here (apt-get as root is needed); the browser tests will be skipped."
  fi
fi
exit 0
