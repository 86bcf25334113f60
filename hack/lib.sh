# shellcheck shell=bash
# Shared functions of the setup scripts that install Debian packages
# (setup-redis.sh, setup-python.sh, setup-prometheus.sh). Source it after
# hack/step.sh:
#
#   source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
#   apt_init fail "install foo by hand" "install foo with your package manager"
#   apt_install_step "installing Debian's foo package" on-failure foo || fail "apt-get install foo failed"

# apt_init FAIL BY_HAND NO_APT sets the array apt to the apt-get command line
# the scripts install with, and the array SUDO to (sudo), or () when root, for
# the commands that stop the services the packages start. apt runs through
# sudo when not root, asking for sudo's password now rather than in a quiet
# step later; passes DEBIAN_FRONTEND through env, because sudo drops the
# environment; and waits up to 120s for another apt (unattended-upgrades,
# another setup script) to release its lock. When it cannot, it calls the
# function FAIL, which is expected to exit, with a message that ends with
# BY_HAND (what to install by hand) or, when apt-get is missing, NO_APT.
apt_init() {
  local fail="$1" by_hand="$2" no_apt="$3"
  SUDO=()
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
      SUDO=(sudo)
    else
      "${fail}" "not root and sudo is not installed: ${by_hand}"
    fi
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    "${fail}" "apt-get not found: ${no_apt}"
  fi
  if [ "${#SUDO[@]}" -gt 0 ]; then
    "${SUDO[@]}" -v || "${fail}" "sudo failed: ${by_hand}"
  fi
  apt=("${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=120)
}

# apt_install_step DESCRIPTION UPDATE PACKAGE... installs the packages with
# "${apt[@]}" (see apt_init) as one step (hack/step.sh) described as
# DESCRIPTION. UPDATE says when to refresh the package index: "first", before
# installing, or "on-failure", only when installing from the current index
# fails, and then install again.
apt_install_step() {
  local what="$1" update="$2"
  shift 2
  step "${what}" apt_install "${update}" "$#" "$@" "${apt[@]}"
}

# apt_install UPDATE N PACKAGE... APT-GET-COMMAND... is the command of
# apt_install_step's step. It runs in the step's new bash, where the apt array
# does not exist (bash cannot export arrays), so it takes the command line as
# arguments, after the N packages.
apt_install() {
  local update="$1" packages=("${@:3:$2}")
  shift "$(($2 + 2))"
  case "${update}" in
  first)
    "$@" update
    "$@" install -y --no-install-recommends "${packages[@]}"
    ;;
  on-failure)
    "$@" install -y --no-install-recommends "${packages[@]}" ||
      { "$@" update && "$@" install -y --no-install-recommends "${packages[@]}"; }
    ;;
  *)
    echo "apt_install: UPDATE is ${update}, want first or on-failure" >&2
    return 2
    ;;
  esac
}
export -f apt_install
