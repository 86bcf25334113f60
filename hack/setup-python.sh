#!/usr/bin/env bash
# Makes sure Debian's python3 (/usr/bin/python3) can import the modules the
# Python client's tests need: redis (python3-redis), celery (python3-celery),
# pytest (python3-pytest) and prometheus_client (python3-prometheus-client).
# Missing ones are installed from Debian's packages with apt-get; the index is
# refreshed (apt-get update) only when the first install fails. The tests run
# on Debian's interpreter, never on another python3 that may come first on
# PATH, because these are Debian's packages. Safe to run any number of times;
# one progress line goes to stderr.
set -euo pipefail

log() { printf 'setup-python: %s\n' "$*" >&2; }

PYTHON=/usr/bin/python3
declare -A modules=(
  [redis]=python3-redis
  [celery]=python3-celery
  [pytest]=python3-pytest
  [prometheus_client]=python3-prometheus-client
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

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
  else
    log "not root and sudo is not installed: install ${packages[*]} by hand"
    exit 1
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  log "apt-get not found: install ${packages[*]} (or their equivalents for ${PYTHON}) by hand"
  exit 1
fi

log "installing Debian's ${packages[*]}"
export DEBIAN_FRONTEND=noninteractive
install() { "${SUDO[@]}" apt-get install -y -qq -o DPkg::Lock::Timeout=120 --no-install-recommends "${packages[@]}" >/dev/null 2>&1; }
if ! install; then
  "${SUDO[@]}" apt-get update -qq -o DPkg::Lock::Timeout=120 >/dev/null 2>&1 || { log "apt-get update failed"; exit 1; }
  install || { log "apt-get install ${packages[*]} failed"; exit 1; }
fi

for module in "${!modules[@]}"; do
  "${PYTHON}" -c "import ${module}" >/dev/null 2>&1 || { log "${PYTHON} still cannot import ${module}"; exit 1; }
done
