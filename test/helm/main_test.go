// Package helm tests the Helm chart (charts/spillway) with a real helm, built
// from the Go module proxy by hack/setup-helm.sh, against a real
// kube-apiserver and etcd (envtest): lint, template and server-side dry-run,
// install, upgrade and uninstall, the values schema, and the chart's CRD and
// ClusterRole against config/.
//
// Without helm the tests skip, saying why, unless SPILLWAY_REQUIRE_HELM is
// set (`make test` sets it), when they fail.
package helm

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/yaml"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/testenv"
)

const (
	// helmVersion is the helm hack/setup-helm.sh builds (HELM_VERSION).
	helmVersion = "4.3.2"
	// prometheusOperator is the module whose CRDs (ServiceMonitor,
	// PrometheusRule) the API server gets, so the chart's monitoring objects
	// are checked against their real schema.
	prometheusOperator = "github.com/prometheus-operator/prometheus-operator@v0.85.0"
	// namespace is where the releases go.
	namespace = "spillway-system"
)

var (
	// skip, when set, is why every test skips: helm is missing.
	skip string
	// helmBin is the helm binary.
	helmBin string
	// kubeconfig is a kubeconfig file for the API server, as an admin user.
	kubeconfig string
	// k8s is a client of the API server.
	k8s client.Client
	// helmHome holds helm's cache, config and data directories.
	helmHome string
)

func TestMain(m *testing.M) {
	bin, err := findHelm()
	if err != nil {
		if os.Getenv("SPILLWAY_REQUIRE_HELM") != "" {
			fmt.Fprintf(os.Stderr, "SPILLWAY_REQUIRE_HELM is set and %v\n", err)
			os.Exit(1)
		}
		skip = fmt.Sprintf("%v: run 'make helm' (hack/setup-helm.sh) to build it; set SPILLWAY_REQUIRE_HELM=1 to fail instead of skipping", err)
		os.Exit(m.Run())
	}
	helmBin = bin
	os.Exit(run(m))
}

// run starts the API server, runs the tests and stops it.
func run(m *testing.M) int {
	dir, err := os.MkdirTemp("", "spillway-helm-test")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	helmHome = dir
	buildManager(dir)
	env, err := start(dir)
	if err != nil {
		fmt.Fprintf(os.Stderr, "failed to start envtest: %v\n", err)
		return 1
	}
	defer func() {
		if err := env.Stop(); err != nil {
			fmt.Fprintf(os.Stderr, "failed to stop envtest: %v\n", err)
		}
	}()
	return m.Run()
}

// start starts kube-apiserver and etcd with the prometheus-operator CRDs but
// without Spillway's, which the chart installs; writes a kubeconfig of an
// admin user into dir; and creates the namespace the releases go to.
func start(dir string) (*envtest.Environment, error) {
	monitoring, err := monitoringCRDs()
	if err != nil {
		return nil, err
	}
	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{
		clientgoscheme.AddToScheme, apiextensionsv1.AddToScheme, spillwayv1alpha1.AddToScheme,
	} {
		if err := add(scheme); err != nil {
			return nil, err
		}
	}
	env := &envtest.Environment{
		BinaryAssetsDirectory: assetsDir(),
		CRDDirectoryPaths:     monitoring,
		ErrorIfCRDPathMissing: true,
		Scheme:                scheme,
	}
	cfg, err := env.Start()
	if err != nil {
		_ = env.Stop()
		return nil, err
	}
	stop := func(err error) (*envtest.Environment, error) {
		_ = env.Stop()
		return nil, err
	}
	user, err := env.AddUser(envtest.User{Name: "helm", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		return stop(fmt.Errorf("failed to add a user: %w", err))
	}
	config, err := user.KubeConfig()
	if err != nil {
		return stop(fmt.Errorf("failed to write a kubeconfig: %w", err))
	}
	kubeconfig = filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(kubeconfig, config, 0o600); err != nil {
		return stop(err)
	}
	if k8s, err = client.New(cfg, client.Options{Scheme: scheme}); err != nil {
		return stop(err)
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}
	if err := k8s.Create(context.Background(), ns); err != nil {
		return stop(err)
	}
	return env, nil
}

// findHelm is $SPILLWAY_HELM, else the helm hack/setup-helm.sh caches.
func findHelm() (string, error) {
	bin := os.Getenv("SPILLWAY_HELM")
	if bin == "" {
		version := os.Getenv("HELM_VERSION")
		if version == "" {
			version = helmVersion
		}
		bin = filepath.Join(cacheDir(), "helm", version, "helm")
	}
	if _, err := os.Stat(bin); err != nil {
		return "", fmt.Errorf("helm not found at %s", bin)
	}
	return bin, nil
}

// cacheDir is $SPILLWAY_CACHE, else ~/.cache/spillway, as in the Makefile.
func cacheDir() string {
	if dir := os.Getenv("SPILLWAY_CACHE"); dir != "" {
		return dir
	}
	base, err := os.UserCacheDir()
	if err != nil {
		base = os.TempDir()
	}
	return filepath.Join(base, "spillway")
}

// assetsDir holds kube-apiserver and etcd: KUBEBUILDER_ASSETS, else the
// cache hack/setup-envtest.sh fills.
func assetsDir() string {
	if dir := os.Getenv("KUBEBUILDER_ASSETS"); dir != "" {
		return dir
	}
	return filepath.Join(cacheDir(), "envtest", testenv.K8sVersion)
}

// monitoringCRDs are the ServiceMonitor and PrometheusRule CRDs of the
// prometheus-operator module, which hack/setup-helm.sh downloads.
func monitoringCRDs() ([]string, error) {
	cmd := exec.Command("go", "mod", "download", "-json", prometheusOperator)
	cmd.Dir = os.TempDir() // outside any module: nothing is added to go.mod
	cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod", "GOWORK=off")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("failed to download %s (hack/setup-helm.sh does): %s: %w", prometheusOperator, strings.TrimSpace(stderr.String()), err)
	}
	var dir string
	for line := range strings.SplitSeq(string(out), "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), `"Dir": "`); ok {
			dir = strings.TrimSuffix(v, `",`)
		}
	}
	if dir == "" {
		return nil, fmt.Errorf("go mod download %s named no directory", prometheusOperator)
	}
	crds := filepath.Join(dir, "example", "prometheus-operator-crd")
	return []string{
		filepath.Join(crds, "monitoring.coreos.com_servicemonitors.yaml"),
		filepath.Join(crds, "monitoring.coreos.com_prometheusrules.yaml"),
	}, nil
}

// setup skips the test when helm is missing.
func setup(t *testing.T) {
	t.Helper()
	if skip != "" {
		t.Skip(skip)
	}
}

// chartDir is charts/spillway.
func chartDir() string {
	return filepath.Join(testenv.RepoRoot(), "charts", "spillway")
}

// valuesFiles are the values the chart is tested with: its defaults ("")
// and each file under charts/spillway/ci.
func valuesFiles(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(chartDir(), "ci", "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("no values file under charts/spillway/ci")
	}
	return append([]string{""}, files...)
}

// valuesArgs are the arguments that pass a values file to helm.
func valuesArgs(file string) []string {
	if file == "" {
		return nil
	}
	return []string{"--values", file}
}

// name is a values file's name for a subtest.
func name(file string) string {
	if file == "" {
		return "default"
	}
	return filepath.Base(file)
}

// helm runs helm with a kubeconfig for the API server and its own home, and
// returns its stdout, stderr and error.
func helm(args ...string) (stdout, stderr string, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, helmBin, args...)
	cmd.Env = append(os.Environ(),
		"KUBECONFIG="+kubeconfig,
		"HELM_CACHE_HOME="+filepath.Join(helmHome, "cache"),
		"HELM_CONFIG_HOME="+filepath.Join(helmHome, "config"),
		"HELM_DATA_HOME="+filepath.Join(helmHome, "data"),
	)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err = cmd.Run()
	return out.String(), errOut.String(), err
}

// mustHelm runs helm and fails the test when it fails.
func mustHelm(t *testing.T, args ...string) string {
	t.Helper()
	out, errOut, err := helm(args...)
	if err != nil {
		t.Fatalf("helm %s: %v\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), err, out, errOut)
	}
	return out
}

// objects parses a stream of YAML documents (helm template's output) into
// objects, with the JSON types of unstructured (int64, not float64).
func objects(t *testing.T, manifest string) []*unstructured.Unstructured {
	t.Helper()
	var objs []*unstructured.Unstructured
	r := utilyaml.NewYAMLReader(bufio.NewReader(strings.NewReader(manifest)))
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("failed to split the YAML documents: %v", err)
		}
		j, err := yaml.YAMLToJSON(doc)
		if err != nil {
			t.Fatalf("failed to parse a YAML document: %v\n%s", err, doc)
		}
		if string(bytes.TrimSpace(j)) == "null" {
			continue // only comments
		}
		u := &unstructured.Unstructured{}
		if err := u.UnmarshalJSON(j); err != nil {
			t.Fatalf("failed to parse an object: %v\n%s", err, doc)
		}
		objs = append(objs, u)
	}
	return objs
}
