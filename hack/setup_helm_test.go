package hack

import (
	"os/exec"
	"path/filepath"
	"testing"
)

// TestSetupHelmIsSilentOnACachedMachine checks that hack/setup-helm.sh prints
// the cached helm's path and nothing else once helm is built and the
// prometheus-operator module is in the module cache.
func TestSetupHelmIsSilentOnACachedMachine(t *testing.T) {
	cmd := exec.Command("go", "mod", "download", "github.com/prometheus-operator/prometheus-operator@v0.85.0")
	cmd.Dir = "/"
	cmd.Env = append(cmd.Environ(), "GOPROXY=off", "GOFLAGS=-mod=mod")
	if err := cmd.Run(); err != nil {
		t.Skipf("the prometheus-operator module is not in the module cache (make helm downloads it): %v", err)
	}
	env, _ := cachedMachine(t)
	cache := t.TempDir()
	helm := filepath.Join(cache, "helm", "4.3.2", "helm")
	executable(t, helm)
	env = append(env, "SPILLWAY_CACHE="+cache, "HELM_VERSION=4.3.2")
	code, out, errOut := script(t, env, "./setup-helm.sh")
	if code != 0 || out != helm+"\n" || errOut != "" {
		t.Errorf("setup-helm.sh: exit %d, stdout %q (want %q), stderr %q (want nothing)", code, out, helm+"\n", errOut)
	}
}
