// Package testenv starts a real kube-apiserver and etcd (controller-runtime's
// envtest) with the Spillway and KEDA CRDs installed, for integration tests.
//
// The binaries come from hack/setup-envtest.sh, which builds them from the Go
// module proxy; `make test` runs it and exports KUBEBUILDER_ASSETS.
package testenv

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	goruntime "runtime"
	"strings"
	"testing"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
)

// K8sVersion is the Kubernetes version the envtest binaries are built at.
const K8sVersion = "1.37.2"

// Env is a running control plane.
type Env struct {
	Environment *envtest.Environment
	Config      *rest.Config
	Client      client.Client
	Scheme      *runtime.Scheme
}

// Scheme returns a scheme with the built-in, Spillway and KEDA types.
func Scheme() *runtime.Scheme {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{
		clientgoscheme.AddToScheme,
		spillwayv1alpha1.AddToScheme,
		kedav1alpha1.AddToScheme,
	} {
		if err := add(s); err != nil {
			panic(fmt.Sprintf("failed to build scheme: %v", err))
		}
	}
	return s
}

// Option changes what Start installs.
type Option func(*options)

type options struct{ withoutKEDA bool }

// WithoutKEDA starts the control plane without KEDA's CRDs, as a cluster
// KEDA is not installed in; Env.InstallKEDA installs them later.
func WithoutKEDA() Option { return func(o *options) { o.withoutKEDA = true } }

// Start starts kube-apiserver and etcd with the CRDs installed. Call Stop when
// done (TestMain is the usual place).
func Start(opts ...Option) (*Env, error) {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	assets, err := assetsDir()
	if err != nil {
		return nil, err
	}
	crds := []string{filepath.Join(RepoRoot(), "config", "crd", "bases")}
	if !o.withoutKEDA {
		kedaCRD, err := KEDACRDPath()
		if err != nil {
			return nil, err
		}
		crds = append(crds, kedaCRD)
	}
	scheme := Scheme()
	env := &envtest.Environment{
		BinaryAssetsDirectory: assets,
		CRDDirectoryPaths:     crds,
		ErrorIfCRDPathMissing: true,
		Scheme:                scheme,
	}
	cfg, err := env.Start()
	if err != nil {
		_ = env.Stop()
		return nil, fmt.Errorf("failed to start envtest from %s: %w", assets, err)
	}
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		_ = env.Stop()
		return nil, fmt.Errorf("failed to create client: %w", err)
	}
	return &Env{Environment: env, Config: cfg, Client: c, Scheme: scheme}, nil
}

// InstallKEDA installs KEDA's ScaledObject CRD, as `helm install keda`
// would, and waits until the API server serves it.
func (e *Env) InstallKEDA() error {
	path, err := KEDACRDPath()
	if err != nil {
		return err
	}
	if _, err := envtest.InstallCRDs(e.Config, envtest.CRDInstallOptions{Paths: []string{path}, ErrorIfPathMissing: true}); err != nil {
		return fmt.Errorf("failed to install KEDA's ScaledObject CRD: %w", err)
	}
	return nil
}

// Stop stops the control plane.
func (e *Env) Stop() error {
	return e.Environment.Stop()
}

// RepoRoot is the root of this repository.
func RepoRoot() string {
	_, file, _, _ := goruntime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

// assetsDir finds the kube-apiserver and etcd binaries: KUBEBUILDER_ASSETS,
// else the cache hack/setup-envtest.sh fills.
func assetsDir() (string, error) {
	dir := os.Getenv("KUBEBUILDER_ASSETS")
	if dir == "" {
		cache := os.Getenv("SPILLWAY_CACHE")
		if cache == "" {
			base, err := os.UserCacheDir()
			if err != nil {
				return "", fmt.Errorf("failed to find the user cache directory: %w", err)
			}
			cache = filepath.Join(base, "spillway")
		}
		dir = filepath.Join(cache, "envtest", K8sVersion)
	}
	for _, bin := range []string{"kube-apiserver", "etcd"} {
		if _, err := os.Stat(filepath.Join(dir, bin)); err != nil {
			return "", fmt.Errorf("envtest binary %s missing in %s: run 'make envtest' (hack/setup-envtest.sh) first: %w", bin, dir, err)
		}
	}
	return dir, nil
}

// KEDACRDPath is the ScaledObject CRD of the KEDA module go.mod requires.
func KEDACRDPath() (string, error) {
	dir, err := kedaCRDDir()
	if err != nil {
		return "", err
	}
	return filepath.Join(dir, "keda.sh_scaledobjects.yaml"), nil
}

// kedaCRDDir is config/crd/bases of the KEDA module go.mod requires.
func kedaCRDDir() (string, error) {
	cmd := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "github.com/kedacore/keda/v2")
	cmd.Dir = RepoRoot()
	out, err := cmd.Output()
	if err != nil {
		var exitErr *exec.ExitError
		if errors.As(err, &exitErr) {
			return "", fmt.Errorf("failed to locate the KEDA module: %s: %w", strings.TrimSpace(string(exitErr.Stderr)), err)
		}
		return "", fmt.Errorf("failed to locate the KEDA module: %w", err)
	}
	dir := strings.TrimSpace(string(out))
	if dir == "" {
		return "", errors.New("the KEDA module is not downloaded: run 'go mod download'")
	}
	return filepath.Join(dir, "config", "crd", "bases"), nil
}

// RunTests is a package's TestMain: it starts the control plane into *env,
// runs the package's tests, stops the control plane and exits with the
// tests' code.
func RunTests(m *testing.M, env **Env) {
	e, err := Start()
	if err != nil {
		fmt.Fprintf(os.Stderr, "failed to start envtest: %v\n", err)
		os.Exit(1)
	}
	*env = e
	code := m.Run()
	if err := e.Stop(); err != nil {
		fmt.Fprintf(os.Stderr, "failed to stop envtest: %v\n", err)
	}
	os.Exit(code)
}
