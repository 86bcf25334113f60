#!/usr/bin/env bash
# Makes sure a prometheus server binary is on PATH, installing Debian's
# prometheus package (2.42 on bookworm) when it is not. The tests start their
# own server on a free loopback port with a temporary config and TSDB (see
# internal/promtest), so the system service the package installs is stopped
# and left stopped. Safe to run any number of times; quiet unless it
# installs, and then one progress line on stderr.
set -euo pipefail

log() { printf 'setup-prometheus: %s\n' "$*" >&2; }

if [ -n "${PROMETHEUS:-}" ] && [ -x "${PROMETHEUS}" ]; then
  exit 0
fi
if command -v prometheus >/dev/null 2>&1; then
  exit 0
fi

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
  else
    log "not root and sudo is not installed: install the prometheus package by hand, or set PROMETHEUS to a prometheus binary"
    exit 1
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  log "apt-get not found: install a prometheus server (2.x) with your package manager, or set PROMETHEUS to its binary"
  exit 1
fi

log "installing Debian's prometheus package"
export DEBIAN_FRONTEND=noninteractive
quiet="$(mktemp)"
trap 'rm -f "${quiet}"' EXIT
if ! { "${SUDO[@]}" apt-get update && "${SUDO[@]}" apt-get install -y --no-install-recommends prometheus; } >"${quiet}" 2>&1; then
  tail -n 20 "${quiet}" >&2
  log "apt-get install prometheus failed"
  exit 1
fi

# The post-install script may start the system service on port 9090. The
# tests never use it, so stop it, and keep it from coming back at boot.
if command -v service >/dev/null 2>&1; then
  "${SUDO[@]}" service prometheus stop >/dev/null 2>&1 || true
fi
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
  "${SUDO[@]}" systemctl disable --now prometheus >/dev/null 2>&1 || true
fi
pidfile=/run/prometheus/prometheus.pid
if [ -r "${pidfile}" ]; then
  pid="$(cat "${pidfile}")"
  if [ -n "${pid}" ] && kill -0 "${pid}" 2>/dev/null; then
    "${SUDO[@]}" kill "${pid}" || true
  fi
fi

command -v prometheus >/dev/null 2>&1 || { log "prometheus still not on PATH after install"; exit 1; }
