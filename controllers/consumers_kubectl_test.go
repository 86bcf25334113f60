package controllers

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	. "github.com/onsi/gomega"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/spillway-dev/spillway/internal/redistest"
)

// kubectl runs the kubectl on PATH against env as an administrator; the
// test is skipped when there is none.
type kubectl struct {
	t          testing.TB
	kubeconfig string
	dir        string
}

func newKubectl(t testing.TB) *kubectl {
	t.Helper()
	if _, err := exec.LookPath("kubectl"); err != nil {
		t.Skip("kubectl is not on PATH")
	}
	user, err := env.Environment.AddUser(envtest.User{Name: "gitops", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		t.Fatalf("failed to add a user: %v", err)
	}
	kc, err := user.KubeConfig()
	if err != nil {
		t.Fatalf("failed to write a kubeconfig: %v", err)
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(path, kc, 0o600); err != nil {
		t.Fatalf("failed to write a kubeconfig: %v", err)
	}
	return &kubectl{t: t, kubeconfig: path, dir: dir}
}

// apply runs `kubectl apply <flags> -f` on a ScaledObject manifest with the
// user's min and max, and returns its output.
func (k *kubectl) apply(ns, name string, min, max int, flags ...string) (string, error) {
	manifest := fmt.Sprintf(`apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata:
  name: %s
  namespace: %s
spec:
  scaleTargetRef:
    name: %s
  minReplicaCount: %d
  maxReplicaCount: %d
  triggers:
  - type: cpu
    metadata:
      value: "50"
`, name, ns, name, min, max)
	file := filepath.Join(k.dir, name+".yaml")
	if err := os.WriteFile(file, []byte(manifest), 0o600); err != nil {
		k.t.Fatalf("failed to write the manifest: %v", err)
	}
	args := append([]string{"--kubeconfig", k.kubeconfig, "apply"}, flags...)
	out, err := exec.Command("kubectl", append(args, "-f", file)...).CombinedOutput()
	return string(out), err
}

// TestKubectlAppliesAgainstABound plays kubectl against Spillway: a
// ScaledObject created with client-side apply is bounded; kubectl's
// server-side apply of another max conflicts with spillway-controller; forced,
// it takes max (kubectl's first server-side apply over a client-side-applied
// object applies the manifest twice, migrating managedFields in between) and
// Spillway records 60 and bounds it again; once the policy is deleted, 60 is
// back and a plain server-side apply conflicts with nobody.
func TestKubectlAppliesAgainstABound(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	k := newKubectl(t)
	ns := newNamespace(t)
	srv := redistest.Start(t)
	startManager(t, ns, managerRedis(srv), testOptions)

	createDeployment(t, ns, "render", 4)
	out, err := k.apply(ns, "render", 2, 80)
	g.Expect(err).NotTo(HaveOccurred(), out)
	createPolicy(t, ns, "template-api", testSpec("render"))
	g.Eventually(replicasOf(ns, "render")).Should(Equal("min=2 max=40"))

	out, err = k.apply(ns, "render", 2, 60, "--server-side")
	g.Expect(err).To(HaveOccurred())
	g.Expect(out).To(ContainSubstring(`conflict with "spillway-controller": .spec.maxReplicaCount`))
	g.Expect(replicasOf(ns, "render")(g)).To(Equal("min=2 max=40"))

	out, err = k.apply(ns, "render", 2, 60, "--server-side", "--force-conflicts", "-v=6")
	g.Expect(err).NotTo(HaveOccurred(), out)
	applies := 0
	for _, line := range strings.Split(out, "\n") {
		if strings.Contains(line, "PATCH") && strings.Contains(line, "fieldManager=kubectl&") && strings.Contains(line, "force=true") {
			applies++
		}
	}
	g.Expect(applies).To(Equal(2), "the first forced server-side apply over a client-side-applied object applies twice:\n%s", out)
	g.Eventually(func(g Gomega) string {
		return getScaledObject(g, ns, "render").Annotations[AnnotationOriginalReplicas]
	}).Should(Equal(`{"min":2,"max":60}`))
	g.Eventually(replicasOf(ns, "render")).Should(Equal("min=2 max=40"))

	deletePolicy(g, ns, "template-api")
	expectLetGo(g, ns, "render", "min=2 max=60")
	out, err = k.apply(ns, "render", 2, 50, "--server-side")
	g.Expect(err).NotTo(HaveOccurred(), out)
	g.Expect(replicasOf(ns, "render")(g)).To(Equal("min=2 max=50"))
}
