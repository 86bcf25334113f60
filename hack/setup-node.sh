#!/usr/bin/env bash
# Makes sure node (20 or later) and npm are on PATH, installing Debian's
# nodejs and npm packages when they are not, and that clients/node's
# node_modules holds exactly what the committed package-lock.json says
# (`npm ci`, from the npm registry, only when the lockfile changed since the
# last install: a stamp in node_modules records its SHA-256). Safe to run any
# number of times. Prints nothing when everything is there, else one line
# per step on stderr ("installing the Node client's npm modules (npm ci)...
# done in 12s"); npm's and apt's own output is shown only when they fail, or
# as it comes with SPILLWAY_VERBOSE=1 (see hack/step.sh).
set -euo pipefail

log() { printf 'setup-node: %s\n' "$*" >&2; }
# shellcheck source=hack/step.sh
source "$(dirname "${BASH_SOURCE[0]}")/step.sh"
# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/../clients/node" && pwd)"
fail() { log "$1"; exit 1; }

node_major() { node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0; }

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  apt_init fail "install Node.js 20 or later and npm by hand" "install Node.js 20 or later and npm with your package manager"
  apt_install_step "installing Debian's nodejs and npm packages" on-failure nodejs npm || fail "apt-get install nodejs npm failed"
fi
if [ "$(node_major)" -lt 20 ]; then
  fail "node $(node --version) is too old: the Node client needs Node.js 20 or later"
fi

lock_sum="$(sha256sum "${dir}/package-lock.json" | cut -d' ' -f1)"
stamp="${dir}/node_modules/.spillway-lock-sha256"
if [ -r "${stamp}" ] && [ "$(cat "${stamp}")" = "${lock_sum}" ]; then
  exit 0
fi
npm_ci() {
  cd "${dir}"
  npm ci --no-audit --no-fund
  printf '%s\n' "${lock_sum}" >node_modules/.spillway-lock-sha256
}
export -f npm_ci
export dir lock_sum
step "installing the Node client's npm modules (npm ci)" npm_ci || fail "npm ci failed in ${dir}"
