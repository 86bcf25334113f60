#!/usr/bin/env bash
# Makes sure Debian's python3 (/usr/bin/python3) can import the modules the
# Python client's tests need: redis (python3-redis), celery (python3-celery),
# pytest (python3-pytest), prometheus_client (python3-prometheus-client), and
# the HTTP and RPC clients whose timeouts the guard classifies, each tested
# with the library itself: requests, urllib3, httpx and grpc (python3-grpcio).
# Missing ones are installed from Debian's packages with apt-get; the index is
# refreshed (apt-get update) only when the first install fails. The tests run
# on Debian's interpreter, never on another python3 that may come first on
# PATH, because these are Debian's packages. Safe to run any number of times.
# Prints nothing when the modules are there, else one line on stderr
# ("installing Debian's python3-celery package(s)... done in 40s"); apt's own
# output is shown only when it fails, or as it comes with SPILLWAY_VERBOSE=1
# (see hack/step.sh).
#
# SPILLWAY_PYTHON replaces /usr/bin/python3 for hack/scripts_test.go, which
# runs this script against a stand-in interpreter and apt-get; make does not
# set it.
set -euo pipefail

log() { printf 'setup-python: %s\n' "$*" >&2; }
# shellcheck source=hack/step.sh
source "$(dirname "${BASH_SOURCE[0]}")/step.sh"
# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PYTHON="${SPILLWAY_PYTHON:-/usr/bin/python3}"
declare -A modules=(
  [redis]=python3-redis
  [celery]=python3-celery
  [pytest]=python3-pytest
  [prometheus_client]=python3-prometheus-client
  [requests]=python3-requests
  [urllib3]=python3-urllib3
  [httpx]=python3-httpx
  [grpc]=python3-grpcio
)

# The common case, everything there, costs one interpreter start.
if [ -x "${PYTHON}" ] && "${PYTHON}" -c "import $(IFS=,; echo "${!modules[*]}")" >/dev/null 2>&1; then
  exit 0
fi

packages=()
if [ ! -x "${PYTHON}" ]; then
  packages+=(python3)
fi
for module in "${!modules[@]}"; do
  if [ ! -x "${PYTHON}" ] || ! "${PYTHON}" -c "import ${module}" >/dev/null 2>&1; then
    packages+=("${modules[${module}]}")
  fi
done
if [ "${#packages[@]}" -eq 0 ]; then
  exit 0
fi

# The index is refreshed only when an install from the current one fails.
fail() { log "$1"; exit 1; }
apt_init fail "install ${packages[*]} by hand" "install ${packages[*]} (or their equivalents for ${PYTHON}) by hand"
apt_install_step "installing Debian's ${packages[*]} package(s)" on-failure "${packages[@]}" ||
  fail "apt-get install ${packages[*]} failed"

for module in "${!modules[@]}"; do
  "${PYTHON}" -c "import ${module}" >/dev/null 2>&1 || { log "${PYTHON} still cannot import ${module}"; exit 1; }
done
