#!/usr/bin/env bash
# Builds helm from the Go module proxy (helm.sh/helm/v4) and caches it outside
# the repository, as hack/setup-envtest.sh builds kube-apiserver: the chart's
# tests (test/helm) run it. It is built in a temporary module, so helm never
# becomes a dependency of Spillway's go.mod. The same tests install the
# prometheus-operator CRDs (ServiceMonitor, PrometheusRule) from the module
# github.com/prometheus-operator/prometheus-operator, which this script puts
# in the Go module cache. Prints the path of the helm binary on stdout. On
# stderr, one line per step it runs ("building helm v4.3.2... done in 95s")
# and nothing once cached; go's own output is shown only when a step fails,
# or as it comes with SPILLWAY_VERBOSE=1 (see hack/step.sh).
set -euo pipefail

HELM_VERSION="${HELM_VERSION:-4.3.2}"
PROMETHEUS_OPERATOR_VERSION="${PROMETHEUS_OPERATOR_VERSION:-0.85.0}"
CACHE_ROOT="${SPILLWAY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/spillway}"
DEST="${CACHE_ROOT}/helm/${HELM_VERSION}"

# shellcheck source=hack/step.sh
source "$(dirname "${BASH_SOURCE[0]}")/step.sh"

export GOFLAGS="-mod=mod"
export GOWORK=off
operator="github.com/prometheus-operator/prometheus-operator@v${PROMETHEUS_OPERATOR_VERSION}"
# Outside any module, so that nothing is added to a go.mod.
if ! (cd / && GOPROXY=off go mod download "${operator}") >/dev/null 2>&1; then
  step "downloading the prometheus-operator v${PROMETHEUS_OPERATOR_VERSION} CRDs (once)" \
    bash -c 'cd / && go mod download "$1"' download "${operator}"
fi

if [ -x "${DEST}/helm" ]; then
  echo "${DEST}/helm"
  exit 0
fi

mkdir -p "${DEST}"
work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT

build_helm() {
  cd "${work}"
  go mod init spillway.local/helm
  go get "helm.sh/helm/v4/cmd/helm@v${HELM_VERSION}"
  # The version helm reports (helm version) is stamped as helm's own Makefile does.
  CGO_ENABLED=0 go build -trimpath \
    -ldflags="-s -w -X helm.sh/helm/v4/internal/version.version=v${HELM_VERSION} -X helm.sh/helm/v4/internal/version.metadata=" \
    -o "${work}/helm-bin" helm.sh/helm/v4/cmd/helm
  mv "${work}/helm-bin" "${DEST}/helm"
}

# step runs the build in a new bash, with errexit on.
export -f build_helm
export DEST work HELM_VERSION

step "building helm v${HELM_VERSION} (minutes on 2 cores, once)" build_helm
echo "${DEST}/helm"
