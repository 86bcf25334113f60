#!/usr/bin/env bash
# Makes sure redis-server and redis-cli are on PATH, installing Debian's
# redis-server package when they are not. The integration tests start their
# own redis-server processes on free loopback ports (see internal/redistest),
# so the system service the package installs is stopped and left stopped.
# Safe to run any number of times; progress goes to stderr.
set -euo pipefail

log() { printf 'setup-redis: %s\n' "$*" >&2; }

if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
  exit 0
fi

# Run as root directly, or through sudo when it is available.
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
  else
    log "not root and sudo is not installed: install the redis-server package by hand"
    exit 1
  fi
fi

if ! command -v apt-get >/dev/null 2>&1; then
  log "apt-get not found: install redis-server (7 or newer) with your package manager"
  exit 1
fi

log "installing Debian's redis-server package"
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update >&2
"${SUDO[@]}" apt-get install -y --no-install-recommends redis-server >&2

# The package's post-install script may start the system service on port 6379.
# The tests never use it, so stop it. Without a service manager, kill the
# process named by the service's pid file instead.
if command -v service >/dev/null 2>&1; then
  "${SUDO[@]}" service redis-server stop >/dev/null 2>&1 || true
fi
pidfile=/run/redis/redis-server.pid
if [ -r "${pidfile}" ]; then
  pid="$(cat "${pidfile}")"
  if [ -n "${pid}" ] && kill -0 "${pid}" 2>/dev/null; then
    log "stopping the redis-server service (pid ${pid})"
    "${SUDO[@]}" kill "${pid}" || true
  fi
fi
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
  # Keep it from coming back on the next boot as well.
  "${SUDO[@]}" systemctl disable redis-server >/dev/null 2>&1 || true
fi

for bin in redis-server redis-cli; do
  command -v "${bin}" >/dev/null 2>&1 || { log "${bin} still not on PATH after install"; exit 1; }
done
log "$(redis-server --version)"
