#!/usr/bin/env bash
# Builds the envtest binaries (kube-apiserver, etcd) from the Go module proxy and
# caches them outside the repository, so only the first run on a machine pays.
# Prints the directory to use as KUBEBUILDER_ASSETS on stdout; progress goes to stderr.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-1.37.2}"
ETCD_VERSION="${ETCD_VERSION:-3.6.16}"
CACHE_ROOT="${SPILLWAY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/spillway}"
DEST="${CACHE_ROOT}/envtest/${K8S_VERSION}"

log() { printf 'setup-envtest: %s\n' "$*" >&2; }

if [ -x "${DEST}/kube-apiserver" ] && [ -x "${DEST}/etcd" ]; then
  echo "${DEST}"
  exit 0
fi

mkdir -p "${DEST}"
work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT
export GOFLAGS="-mod=mod"
export GOWORK=off

if [ ! -x "${DEST}/kube-apiserver" ]; then
  log "building kube-apiserver v${K8S_VERSION} (about 5 minutes on 2 cores, once)"
  mkdir -p "${work}/apiserver"
  cd "${work}/apiserver"
  go mod init spillway.local/envtest-apiserver >/dev/null 2>&1
  # k8s.io/kubernetes replaces its staging modules with local paths; a consumer
  # must replace each one with the published module of the matching version.
  gomod="$(go mod download -json "k8s.io/kubernetes@v${K8S_VERSION}" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
  staging="$(sed -n 's#^[[:space:]]*\(k8s\.io/[^[:space:]]*\) => \./staging/src/.*#\1#p' "${gomod}")"
  [ -n "${staging}" ] || { log "no staging modules found in ${gomod}"; exit 1; }
  args=(-require="k8s.io/kubernetes@v${K8S_VERSION}")
  for m in ${staging}; do
    args+=(-replace="${m}=${m}@v0.${K8S_VERSION#1.}")
  done
  go mod edit "${args[@]}"
  go get "k8s.io/kubernetes/cmd/kube-apiserver@v${K8S_VERSION}" >&2
  CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o "${work}/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver
  mv "${work}/kube-apiserver" "${DEST}/kube-apiserver"
fi

if [ ! -x "${DEST}/etcd" ]; then
  log "building etcd v${ETCD_VERSION} (about 30 seconds, once)"
  mkdir -p "${work}/etcd"
  cd "${work}/etcd"
  go mod init spillway.local/envtest-etcd >/dev/null 2>&1
  cat > main.go <<'GO'
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
  go get "go.etcd.io/etcd/server/v3@v${ETCD_VERSION}" >&2
  go mod tidy >&2
  CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o "${work}/etcd-bin" .
  mv "${work}/etcd-bin" "${DEST}/etcd"
fi

log "envtest binaries ready in ${DEST}"
echo "${DEST}"
