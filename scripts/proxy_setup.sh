#!/usr/bin/env bash
# Sets up what the reverse-proxy tests (tests/deploy/server/test_proxy.py) need: Debian's
# nginx at /usr/sbin/nginx, installed with apt-get when missing (as root, without its
# recommended packages): a change to the system, which the README's test command states.
# The tests start their own nginx (a configuration in a temporary directory, on a free
# loopback port) and never touch the system's /etc/nginx; the package's own service is
# not started here (nothing listens on port 80 because of this script).
# Where nginx cannot be had, it says why and the proxy tests are skipped, saying so;
# it never fails. FEDLANG_PROXY_SETUP=0 installs nothing (the tests use what is already
# there). Without a network apt-get gives up within about a minute.
# Output goes to build/proxy_setup.log as well.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
LOG=build/proxy_setup.log
# Where the tests look for nginx; another path only to test this script.
NGINX=${FEDLANG_NGINX:-/usr/sbin/nginx}
: > "$LOG"
say() { echo "proxy setup: $*" | tee -a "$LOG" >&2; }

if [ "${FEDLANG_PROXY_SETUP:-1}" = 0 ]; then
  say "FEDLANG_PROXY_SETUP=0: installing nothing (no apt-get); the reverse-proxy tests will be skipped if nginx is missing."
  exit 0
fi

if [ ! -x "$NGINX" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Debian's nginx with apt-get (a system package; FEDLANG_PROXY_SETUP=0 skips this)..."
    APT=(-q -o Acquire::Retries=0 -o Acquire::http::Timeout=20 -o Acquire::https::Timeout=20)
    # policy-rc.d exit 101: the package's service is not started (no daemon on port 80;
    # a container has no init to start it anyway)
    POLICY=${FEDLANG_POLICY_RC:-/usr/sbin/policy-rc.d}  # another path only to test this script
    MADE_POLICY=0
    if [ ! -e "$POLICY" ]; then
      printf '#!/bin/sh\nexit 101\n' > "$POLICY" && chmod 755 "$POLICY" && MADE_POLICY=1
    fi
    if ! { apt-get "${APT[@]}" update && DEBIAN_FRONTEND=noninteractive apt-get "${APT[@]}" install -y --no-install-recommends nginx; } >>"$LOG" 2>&1; then
      say "apt-get could not install nginx (no network? see $LOG); the reverse-proxy tests will be skipped."
    fi
    if [ "$MADE_POLICY" = 1 ]; then
      rm -f "$POLICY"
    fi
  else
    say "nginx is missing and cannot be installed here (apt-get as root is needed); the reverse-proxy tests will be skipped."
  fi
fi
if [ -x "$NGINX" ]; then
  say "$("$NGINX" -v 2>&1)"
fi
exit 0
