#!/usr/bin/env bash
# Makes sure redis-server, redis-cli and redis-sentinel are on PATH, installing
# Debian's redis-server and redis-sentinel packages when they are not. The
# integration tests start their own processes on free loopback ports (see
# internal/redistest), so the system services the packages install are stopped
# and left stopped. Safe to run any number of times. Prints nothing when the
# programs are there, else one line on stderr ("installing Debian's
# redis-server package... done in 40s"); apt's own output is shown only when
# it fails, or as it comes with SPILLWAY_VERBOSE=1 (see hack/step.sh).
#
# redis-sentinel is the redis-server program started under another name
# (Debian links both to the same binary), and `redis-server sentinel.conf
# --sentinel` runs a sentinel too: internal/redistest falls back to that when
# redis-sentinel is missing, so a machine where only it cannot be installed
# still runs every test.
set -euo pipefail

log() { printf 'setup-redis: %s\n' "$*" >&2; }
# shellcheck source=hack/step.sh
source "$(dirname "${BASH_SOURCE[0]}")/step.sh"
# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

packages=()
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
  packages+=(redis-server)
fi
if ! command -v redis-sentinel >/dev/null 2>&1; then
  packages+=(redis-sentinel)
fi
if [ "${#packages[@]}" -eq 0 ]; then
  exit 0
fi
# Only the sentinel missing: not worth failing over, redis-server --sentinel works.
sentinel_only=false
if [ "${packages[*]}" = "redis-sentinel" ]; then
  sentinel_only=true
fi
cannot() {
  if [ "${sentinel_only}" = true ]; then
    log "$1; redis-sentinel not installed, the tests run redis-server --sentinel instead"
    exit 0
  fi
  log "$1"
  exit 1
}

apt_init cannot "install the ${packages[*]} package(s) by hand" \
  "install redis-server (7 or newer) and redis-sentinel with your package manager"
step "updating Debian's package lists" "${apt[@]}" update || cannot "apt-get update failed"
step "installing Debian's ${packages[*]} package(s)" \
  "${apt[@]}" install -y --no-install-recommends "${packages[@]}" || cannot "apt-get install ${packages[*]} failed"

# The packages' post-install scripts may start the system services on ports
# 6379 and 26379. The tests never use them, so stop them. Without a service
# manager, kill the processes named by the services' pid files instead.
for service in redis-server redis-sentinel; do
  if command -v service >/dev/null 2>&1; then
    "${SUDO[@]}" service "${service}" stop >/dev/null 2>&1 || true
  fi
done
for pidfile in /run/redis/redis-server.pid /run/sentinel/redis-sentinel.pid; do
  if [ -r "${pidfile}" ]; then
    pid="$(cat "${pidfile}")"
    if [ -n "${pid}" ] && kill -0 "${pid}" 2>/dev/null; then
      log "stopping the service of ${pidfile} (pid ${pid})"
      "${SUDO[@]}" kill "${pid}" || true
    fi
  fi
done
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
  # Keep them from coming back on the next boot as well.
  "${SUDO[@]}" systemctl disable redis-server redis-sentinel >/dev/null 2>&1 || true
fi

for bin in redis-server redis-cli redis-sentinel; do
  command -v "${bin}" >/dev/null 2>&1 || { log "${bin} still not on PATH after install"; exit 1; }
done
