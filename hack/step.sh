#!/usr/bin/env bash
# Runs one setup step quietly: prints "DESCRIPTION... done in 12s" on stderr
# and keeps the step's own output (go get's "go: added" lines, apt's progress)
# in a temporary log, printed in full only when the step fails.
# SPILLWAY_VERBOSE=1 streams the step's output instead.
#
#   hack/step.sh "building the spillway CLI" go build -o bin/spillway ./cmd/spillway
#
# Scripts source this file and call the step function. The command runs in a
# new bash with errexit on, so a shell function given as the command must be
# exported (export -f), with the variables it reads, and its first failing
# command fails the step wherever step is called from (bash ignores errexit in
# a function or subshell called from an if or ||).

step() {
  local what="$1"
  shift
  local start=${SECONDS} rc=0 errexit=false log
  case $- in *e*) errexit=true ;; esac
  if [ "${SPILLWAY_VERBOSE:-}" = 1 ]; then
    printf '%s...\n' "${what}" >&2
    set +e
    bash -c 'set -euo pipefail; "$@"' step "$@" >&2
    rc=$?
  else
    printf '%s... ' "${what}" >&2
    log="$(mktemp "${TMPDIR:-/tmp}/spillway-step.XXXXXX")"
    set +e
    bash -c 'set -euo pipefail; "$@"' step "$@" >"${log}" 2>&1 </dev/null
    rc=$?
  fi
  if [ "${errexit}" = true ]; then
    set -e
  fi
  if [ "${rc}" -eq 0 ]; then
    if [ "${SPILLWAY_VERBOSE:-}" = 1 ]; then
      printf '%s: done in %ds\n' "${what}" "$((SECONDS - start))" >&2
    else
      printf 'done in %ds\n' "$((SECONDS - start))" >&2
      rm -f "${log}"
    fi
    return 0
  fi
  if [ "${SPILLWAY_VERBOSE:-}" = 1 ]; then
    printf '%s: failed after %ds (exit status %d)\n' "${what}" "$((SECONDS - start))" "${rc}" >&2
  else
    printf 'failed after %ds (exit status %d); its output:\n' "$((SECONDS - start))" "${rc}" >&2
    cat "${log}" >&2
    rm -f "${log}"
  fi
  return "${rc}"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  if [ "$#" -lt 2 ]; then
    echo "usage: $0 DESCRIPTION COMMAND [ARG...]" >&2
    exit 2
  fi
  step "$@"
fi
