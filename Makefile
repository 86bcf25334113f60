# Spillway. Everything a fresh machine with only Go needs is built or installed
# by the targets below: envtest binaries from the Go module proxy; redis-server,
# prometheus and the Python client's python3-* modules from Debian's packages;
# the Node client's npm modules from the npm registry (package-lock.json).
# Each setup step prints one line ("building etcd v3.6.16... done in 31s",
# nothing once cached) and its tools' output only when
# it fails; SPILLWAY_VERBOSE=1 shows that output as it comes (hack/step.sh).

SHELL := /usr/bin/env bash -o pipefail
.SHELLFLAGS := -ec

K8S_VERSION ?= 1.37.2
ETCD_VERSION ?= 3.6.16
HELM_VERSION ?= 4.3.2
SPILLWAY_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/spillway
ENVTEST_ASSETS := $(SPILLWAY_CACHE)/envtest/$(K8S_VERSION)
export KUBEBUILDER_ASSETS := $(ENVTEST_ASSETS)
export K8S_VERSION ETCD_VERSION HELM_VERSION SPILLWAY_CACHE SPILLWAY_VERBOSE

CONTROLLER_GEN := go tool controller-gen
TEST_FLAGS ?= -count=1 -timeout=30m
BENCH_FLAGS ?= -run='^$$' -benchmem -count=1

.PHONY: all
all: build

##@ Development

.PHONY: generate
generate: ## Generate deepcopy code from the API markers.
	$(CONTROLLER_GEN) object paths=./api/...

.PHONY: manifests
manifests: ## Generate the CRD and RBAC manifests from markers, in config/ and in the Helm chart.
	$(CONTROLLER_GEN) crd:allowDangerousTypes=true rbac:roleName=manager-role \
		paths=./api/... paths=./controllers/... \
		output:crd:artifacts:config=config/crd/bases output:rbac:artifacts:config=config/rbac
	go run ./hack/chartgen

.PHONY: fmt
fmt: ## Run gofmt on the tree.
	gofmt -w $$(git ls-files '*.go')

.PHONY: vet
vet: ## Run go vet.
	go vet ./...

.PHONY: verify
verify: generate manifests ## Fail when generated files, formatting or go.mod are stale, or the protocol's wire changed without a new version (hack/protocolpin).
	@unformatted=$$(gofmt -l $$(git ls-files '*.go')); \
	if [ -n "$$unformatted" ]; then echo "gofmt needed: $$unformatted"; exit 1; fi
	go vet ./...
	go mod tidy -diff
	go run ./hack/protocolpin
	@git diff --exit-code -- api config charts || { echo "generated files are stale: run 'make generate manifests' and commit"; exit 1; }
	@untracked=$$(git ls-files --others --exclude-standard -- api config charts); \
	if [ -n "$$untracked" ]; then echo "generated files are not committed: $$untracked"; exit 1; fi

##@ Test

.PHONY: envtest
envtest: ## Build kube-apiserver and etcd for envtest (cached in $(SPILLWAY_CACHE)).
	@hack/setup-envtest.sh >/dev/null

.PHONY: helm
helm: ## Build helm from the Go module proxy for the chart's tests (cached in $(SPILLWAY_CACHE)).
	@hack/setup-helm.sh >/dev/null

.PHONY: redis
redis: ## Install redis-server and redis-sentinel from Debian's packages when they are missing.
	@hack/setup-redis.sh

.PHONY: modules
modules: ## Download the Go modules the build and tests need, when they are not in the module cache.
	@GOPROXY=off go mod download >/dev/null 2>&1 || hack/step.sh "downloading Go modules" go mod download

.PHONY: prometheus
prometheus: ## Install Debian's prometheus server when it is missing (tests start their own on loopback).
	@hack/setup-prometheus.sh

.PHONY: python-test
python-test: redis ## Run the Python client's tests on Debian's python3 (modules installed by hack/setup-python.sh).
	@hack/setup-python.sh
	/usr/bin/python3 -m pytest clients/python/tests -q

.PHONY: node-test
node-test: redis ## Run the Node client's tests on node 20+ (npm modules installed from the lockfile by hack/setup-node.sh).
	@hack/setup-node.sh
	cd clients/node && npx --no-install tsc -p tsconfig.json && node --test --test-concurrency=4 --test-timeout=180000 test/*.test.js

.PHONY: test
test: envtest helm redis modules prometheus python-test node-test ## Run every test (Python and Node clients, then Go) against a real kube-apiserver, etcd, redis-server and Prometheus.
	SPILLWAY_REQUIRE_PYTHON=1 SPILLWAY_REQUIRE_NODE=1 SPILLWAY_REQUIRE_HELM=1 go test $(TEST_FLAGS) ./...

SOAK ?= 1h
SOAK_TIMEOUT ?= 24h

.PHONY: soak
soak: envtest redis modules ## Run the fault campaign's soak: random faults for $(SOAK) (make soak SOAK=10m), then its report; fails on any breach outside knownBreaches.
	@hack/setup-python.sh
	SOAK=$(SOAK) SPILLWAY_REQUIRE_PYTHON=1 go test -count=1 -timeout=$(SOAK_TIMEOUT) -run '^TestFaultSoak(Sentinel)?$$' -v ./test/faults

.PHONY: skew-long
skew-long: envtest redis modules ## Run the long form of the version-skew test (test/skew): more workers, outages, manager switches and worker rollbacks.
	@hack/setup-python.sh
	SPILLWAY_REQUIRE_PYTHON=1 SPILLWAY_SKEW_LONG=1 go test -count=1 -timeout=30m -v -run '^TestRollingUpgradeUnderLoad$$' ./test/skew

.PHONY: bench
bench: envtest redis modules ## Run the benchmarks whose figures go in docs/benchmarks.md.
	go test $(BENCH_FLAGS) -bench=. ./...

##@ Build and run

.PHONY: demo
demo: envtest redis modules ## Replay an outage on loopback, live, and write spillway-demo.png.
	@hack/step.sh "building the spillway CLI" go build -o bin/spillway ./cmd/spillway
	@bin/spillway demo

.PHONY: build
build: ## Build the manager, the spillway CLI and the kubectl-spillway plugin into bin/.
	go build -o bin/manager ./cmd/manager
	go build -o bin/spillway ./cmd/spillway
	go build -o bin/kubectl-spillway ./cmd/kubectl-spillway

IMG ?= ghcr.io/spillway-dev/spillway-manager:v0.1.0

.PHONY: docker-build
docker-build: ## Build the manager image (needs a Docker engine).
	docker build -t $(IMG) .

.PHONY: run
run: ## Run the manager against the current kubeconfig and a Redis at 127.0.0.1:6379 (more flags: ARGS=...).
	go run ./cmd/manager --leader-elect=false $(ARGS)
