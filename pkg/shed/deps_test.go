package shed_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestNoKubernetesDependencies keeps the service middleware light enough for
// any Go service: it must not pull in controller-runtime or client-go.
func TestNoKubernetesDependencies(t *testing.T) {
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skipf("go tool not found: %v", err)
	}
	out, err := exec.Command(goTool, "list", "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	for _, pkg := range strings.Fields(string(out)) {
		for _, banned := range []string{"sigs.k8s.io/controller-runtime", "k8s.io/client-go"} {
			if pkg == banned || strings.HasPrefix(pkg, banned+"/") {
				t.Errorf("pkg/shed depends on %s", pkg)
			}
		}
	}
}
