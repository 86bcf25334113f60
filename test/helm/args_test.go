package helm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/spillway-dev/spillway/internal/testenv"
)

// TestManagerAcceptsTheChartsArgs runs the real manager with the arguments
// the chart renders for each values file: the manager exits with status 2
// on a flag it does not know or a combination it refuses (parseFlags), so
// any other outcome means the chart speaks its command line. Without a
// cluster to reach it then stops at the next step, with status 1.
func TestManagerAcceptsTheChartsArgs(t *testing.T) {
	setup(t)
	manager, err := managerBinary()
	if err != nil {
		t.Fatal(err)
	}
	for _, file := range valuesFiles(t) {
		t.Run(name(file), func(t *testing.T) {
			g := NewWithT(t)
			args := renderedArgs(t, file)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, manager, args...)
			// No cluster: the manager must get past its flags and stop at
			// the next step.
			home := t.TempDir()
			cmd.Env = append(os.Environ(), "HOME="+home, "KUBECONFIG="+filepath.Join(home, "none"),
				"KUBERNETES_SERVICE_HOST=", "KUBERNETES_SERVICE_PORT=")
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			err := cmd.Run()
			t.Logf("the manager with %q: %v\n%s", args, err, lastLine(stderr.String()))
			var exit *exec.ExitError
			g.Expect(errors.As(err, &exit)).To(BeTrue(), "the manager ran with no cluster: %v\n%s", err, stderr.String())
			g.Expect(exit.ExitCode()).NotTo(Equal(2), "the manager refused the chart's arguments %q:\n%s", args, stderr.String())
			g.Expect(stderr.String()).NotTo(ContainSubstring("flag provided but not defined"))
		})
	}
}

// renderedArgs are the manager container's arguments in the Deployment the
// chart renders with a values file.
func renderedArgs(t *testing.T, file string) []string {
	t.Helper()
	out := mustHelm(t, append([]string{"template", "spillway", chartDir(), "--namespace", namespace}, valuesArgs(file)...)...)
	for _, u := range objects(t, out) {
		if u.GetKind() != "Deployment" {
			continue
		}
		d := &appsv1.Deployment{}
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, d); err != nil {
			t.Fatal(err)
		}
		for _, c := range d.Spec.Template.Spec.Containers {
			if c.Name == "manager" {
				if len(c.Command) != 1 || !strings.HasSuffix(c.Command[0], "/manager") {
					t.Fatalf("the manager container runs %q, want /manager", c.Command)
				}
				return c.Args
			}
		}
	}
	t.Fatal("the chart renders no Deployment with a manager container")
	return nil
}

// buildManager starts building the manager into dir, while the API server
// starts, and sets managerBinary to wait for it.
func buildManager(dir string) {
	type result struct {
		path string
		err  error
	}
	done := make(chan result, 1)
	go func() {
		path := filepath.Join(dir, "manager")
		build := exec.Command("go", "build", "-o", path, "./cmd/manager")
		build.Dir = testenv.RepoRoot()
		out, err := build.CombinedOutput()
		if err != nil {
			err = fmt.Errorf("failed to build the manager: %w\n%s", err, out)
		}
		done <- result{path, err}
	}()
	managerBinary = sync.OnceValues(func() (string, error) {
		r := <-done
		return r.path, r.err
	})
}

// managerBinary waits for the manager buildManager builds.
var managerBinary func() (string, error)

// lastLine is the last non-empty line of s.
func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}
