#!/usr/bin/env bash
# Builds the envtest binaries (kube-apiserver, etcd) from the Go module proxy and
# caches them outside the repository, so only the first run on a machine pays.
# Prints the directory to use as KUBEBUILDER_ASSETS on stdout. On stderr, one
# line per binary it builds ("building etcd v3.6.16... done in 31s") and
# nothing when both are cached; the go commands' own output is shown only when
# a build fails, or as it comes with SPILLWAY_VERBOSE=1 (see hack/step.sh).
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-1.37.2}"
ETCD_VERSION="${ETCD_VERSION:-3.6.16}"
CACHE_ROOT="${SPILLWAY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/spillway}"
DEST="${CACHE_ROOT}/envtest/${K8S_VERSION}"

# shellcheck source=hack/step.sh
source "$(dirname "${BASH_SOURCE[0]}")/step.sh"

if [ -x "${DEST}/kube-apiserver" ] && [ -x "${DEST}/etcd" ]; then
  echo "${DEST}"
  exit 0
fi

mkdir -p "${DEST}"
work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT
export GOFLAGS="-mod=mod"
export GOWORK=off

build_apiserver() {
  mkdir -p "${work}/apiserver"
  cd "${work}/apiserver"
  go mod init spillway.local/envtest-apiserver
  # k8s.io/kubernetes replaces its staging modules with local paths; a consumer
  # must replace each one with the published module of the matching version.
  local gomod staging m
  gomod="$(go mod download -json "k8s.io/kubernetes@v${K8S_VERSION}" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
  staging="$(sed -n 's#^[[:space:]]*\(k8s\.io/[^[:space:]]*\) => \./staging/src/.*#\1#p' "${gomod}")"
  [ -n "${staging}" ] || { echo "no staging modules found in ${gomod}"; return 1; }
  local args=(-require="k8s.io/kubernetes@v${K8S_VERSION}")
  for m in ${staging}; do
    args+=(-replace="${m}=${m}@v0.${K8S_VERSION#1.}")
  done
  go mod edit "${args[@]}"
  go get "k8s.io/kubernetes/cmd/kube-apiserver@v${K8S_VERSION}"
  CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o "${work}/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver
  mv "${work}/kube-apiserver" "${DEST}/kube-apiserver"
}

build_etcd() {
  mkdir -p "${work}/etcd"
  cd "${work}/etcd"
  go mod init spillway.local/envtest-etcd
  cat > main.go <<'GO'
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
  go get "go.etcd.io/etcd/server/v3@v${ETCD_VERSION}"
  go mod tidy
  CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o "${work}/etcd-bin" .
  mv "${work}/etcd-bin" "${DEST}/etcd"
}

# step runs each build in a new bash, with errexit on.
export -f build_apiserver build_etcd
export DEST work K8S_VERSION ETCD_VERSION

if [ ! -x "${DEST}/kube-apiserver" ]; then
  step "building kube-apiserver v${K8S_VERSION} for envtest (about 5 minutes on 2 cores, once)" build_apiserver
fi
if [ ! -x "${DEST}/etcd" ]; then
  step "building etcd v${ETCD_VERSION} for envtest (about 30 seconds, once)" build_etcd
fi
echo "${DEST}"
