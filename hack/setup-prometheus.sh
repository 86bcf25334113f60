#!/usr/bin/env bash
# Makes sure a prometheus server binary is on PATH (or at $PROMETHEUS),
# installing Debian's prometheus package (2.42 on bookworm) when it is not.
# The tests start their own server on a free loopback port with a temporary
# config and TSDB (see internal/promtest), so the system service the package
# installs is stopped and left stopped. Safe to run any number of times.
# Prints nothing when prometheus is there, else one line on stderr
# ("installing Debian's prometheus package... done in 20s"); apt's own output
# is shown only when it fails, or as it comes with SPILLWAY_VERBOSE=1 (see
# hack/step.sh).
set -euo pipefail

log() { printf 'setup-prometheus: %s\n' "$*" >&2; }
# shellcheck source=hack/step.sh
source "$(dirname "${BASH_SOURCE[0]}")/step.sh"
# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

if [ -n "${PROMETHEUS:-}" ] && [ -x "${PROMETHEUS}" ]; then
  exit 0
fi
if command -v prometheus >/dev/null 2>&1; then
  exit 0
fi

fail() { log "$1"; exit 1; }
apt_init fail "install the prometheus package by hand, or set PROMETHEUS to a prometheus binary" \
  "install a prometheus server (2.x) with your package manager, or set PROMETHEUS to its binary"
apt_install_step "installing Debian's prometheus package" first prometheus || fail "apt-get install prometheus failed"

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
