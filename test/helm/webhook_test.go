package helm

import (
	"context"
	"crypto/tls"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv1 "k8s.io/api/autoscaling/v1"
	corev1 "k8s.io/api/core/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
)

// TestWebhookEndToEnd installs the chart with the webhook (its defaults: the
// manager's own certificates), runs the manager binary with the chart's
// names, and refuses one kubectl scale above a bound: the API server calls
// the chart's ValidatingWebhookConfiguration through the chart's Service
// name, and verifies the certificate the manager made and rotated into the
// chart's Secret.
//
// No pod runs in envtest, so two things stand in for the cluster: the
// Service becomes an ExternalName for localhost (the API server resolves an
// ExternalName Service to that host, at the Service port 443, and still
// checks the certificate for <service>.<namespace>.svc), and the test copies
// the Secret's files where the kubelet would mount them. The manager listens
// on port 443, so the test needs to bind it (it skips otherwise).
func TestWebhookEndToEnd(t *testing.T) {
	setup(t)
	g := NewWithT(t)
	ctx := context.Background()
	if l, err := net.Listen("tcp", ":443"); err != nil {
		t.Skipf("the manager cannot listen on port 443, where the API server calls an ExternalName Service: %v", err)
	} else {
		l.Close()
	}
	// The release's full name is <release>-spillway: the chart's helper adds
	// the chart's name to a release name without it.
	const release, ns, fullname = "hooked", "hooked", "hooked-spillway"

	// The CRD, unless a release before installed it and kept it: this
	// release leaves it alone (crds.install=false).
	// A release before may have kept another chart's CRD (the upgrade
	// test's rollback leaves the pinned commit's), which knows no
	// scaleTargetRef: this test needs this tree's.
	want := &apiextensionsv1.CustomResourceDefinition{}
	g.Expect(runtimeConvert(readYAML(t, "config", "crd", "bases", "spillway.dev_dependencypolicies.yaml"), want)).To(Succeed())
	crd := &apiextensionsv1.CustomResourceDefinition{}
	switch err := k8s.Get(ctx, client.ObjectKey{Name: crdName}, crd); {
	case apierrors.IsNotFound(err):
		g.Expect(k8s.Create(ctx, want)).To(Succeed())
		t.Cleanup(func() { _ = k8s.Delete(context.Background(), want) })
	case err == nil:
		crd.Spec = want.Spec
		g.Expect(k8s.Update(ctx, crd)).To(Succeed())
	default:
		g.Expect(err).NotTo(HaveOccurred())
	}
	g.Eventually(func() map[string]string { return crdSchemas(t) }).WithTimeout(30 * time.Second).Should(Equal(chartCRDSchemas(t, chartDir())))
	mustHelm(t, "install", release, chartDir(), "--namespace", ns, "--create-namespace", "--set", "crds.install=false")
	t.Cleanup(func() { _, _, _ = helm("uninstall", release, "--namespace", ns) })
	webhook := &admissionregistrationv1.ValidatingWebhookConfiguration{}
	g.Expect(k8s.Get(ctx, client.ObjectKey{Name: fullname + "-validating-webhook-configuration"}, webhook)).To(Succeed())
	g.Expect(webhook.Webhooks).NotTo(BeEmpty())
	for _, w := range webhook.Webhooks {
		g.Expect(*w.FailurePolicy).To(Equal(admissionregistrationv1.Ignore))
		g.Expect(w.ClientConfig.Service.Name).To(Equal(fullname + "-webhook-service"))
	}

	// The chart's Service, as an ExternalName for localhost.
	svc := &corev1.Service{}
	g.Expect(k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: fullname + "-webhook-service"}, svc)).To(Succeed())
	g.Expect(k8s.Delete(ctx, svc)).To(Succeed())
	g.Expect(k8s.Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: svc.Name},
		Spec:       corev1.ServiceSpec{Type: corev1.ServiceTypeExternalName, ExternalName: "localhost", Ports: []corev1.ServicePort{{Name: "webhook", Port: 443}}},
	})).To(Succeed())

	// The manager, with the chart's names.
	manager, err := managerBinary()
	g.Expect(err).NotTo(HaveOccurred())
	certDir := t.TempDir()
	mctx, cancel := context.WithCancel(ctx)
	cmd := exec.CommandContext(mctx, manager,
		"--kubeconfig="+kubeconfig, "--leader-election-namespace="+ns,
		"--metrics-bind-address=0", "--health-probe-bind-address=0", "--redis-addr=127.0.0.1:1",
		"--webhook", "--webhook-port=443", "--webhook-cert-dir="+certDir, "--webhook-namespace="+ns,
		"--webhook-cert-secret="+fullname+"-webhook-server-cert",
		"--webhook-service="+fullname+"-webhook-service",
		"--webhook-configuration="+fullname+"-validating-webhook-configuration")
	logPath := filepath.Join(t.TempDir(), "manager.log")
	logFile, err := os.Create(logPath)
	g.Expect(err).NotTo(HaveOccurred())
	cmd.Stdout, cmd.Stderr = logFile, logFile
	g.Expect(cmd.Start()).To(Succeed())
	t.Cleanup(func() {
		cancel()
		_ = cmd.Wait()
		if t.Failed() {
			b, _ := os.ReadFile(logPath)
			t.Logf("the manager's log:\n%s", lastLines(string(b), 40))
		}
	})

	// The rotation fills the chart's Secret and injects the CA; the test
	// mounts the files, and the manager serves.
	secret := &corev1.Secret{}
	g.Eventually(func(g Gomega) {
		g.Expect(k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: fullname + "-webhook-server-cert"}, secret)).To(Succeed())
		g.Expect(secret.Data).To(HaveKey("tls.crt"))
		g.Expect(k8s.Get(ctx, client.ObjectKeyFromObject(webhook), webhook)).To(Succeed())
		g.Expect(webhook.Webhooks[0].ClientConfig.CABundle).To(Equal(secret.Data["ca.crt"]))
	}, time.Minute, 200*time.Millisecond).Should(Succeed())
	for _, k := range []string{"tls.crt", "tls.key", "ca.crt"} {
		g.Expect(os.WriteFile(filepath.Join(certDir, k), secret.Data[k], 0o600)).To(Succeed())
	}
	g.Eventually(func() error {
		conn, err := tls.Dial("tcp", "127.0.0.1:443", &tls.Config{InsecureSkipVerify: true}) //nolint:gosec // only: is it serving?
		if err == nil {
			conn.Close()
		}
		return err
	}, time.Minute, 200*time.Millisecond).Should(Succeed())

	// A workload bounded to 20 replicas, and a kubectl scale to 80.
	labels := map[string]string{"app": "render"}
	d := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "render"},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To[int32](80),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "worker", Image: "worker:latest"}}},
			},
		},
	}
	g.Expect(k8s.Create(ctx, d)).To(Succeed())
	pol := &spillwayv1alpha1.DependencyPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "template-api"},
		Spec: spillwayv1alpha1.DependencyPolicySpec{
			Capacity: spillwayv1alpha1.Capacity{Concurrency: 40},
			Consumers: []spillwayv1alpha1.Consumer{{
				ScaleTargetRef:  &spillwayv1alpha1.ScaleTargetRef{APIVersion: "apps/v1", Kind: "Deployment", Name: "render"},
				SlotsPerReplica: 2,
			}},
		},
	}
	g.Expect(k8s.Create(ctx, pol)).To(Succeed())
	g.Eventually(func(g Gomega) {
		g.Expect(k8s.Get(ctx, client.ObjectKeyFromObject(d), d)).To(Succeed())
		g.Expect(*d.Spec.Replicas).To(BeEquivalentTo(20))
		g.Expect(d.Labels).To(HaveKey("spillway.dev/bounded-by"))
	}, time.Minute, 200*time.Millisecond).Should(Succeed())

	scale := &autoscalingv1.Scale{}
	g.Expect(k8s.SubResource("scale").Get(ctx, d, scale)).To(Succeed())
	scale.Spec.Replicas = 80
	err = k8s.SubResource("scale").Update(ctx, d, client.WithSubResourceBody(scale), client.FieldOwner("kubectl"))
	g.Expect(err).To(HaveOccurred())
	t.Logf("kubectl scale --replicas=80: %v", err)
	g.Expect(apierrors.IsForbidden(err)).To(BeTrue())
	g.Expect(err.Error()).To(ContainSubstring(`admission webhook "scale.replicas.spillway.dev" denied the request: spillway: hooked/template-api serves 40 concurrent calls and render makes 2 per replica, so at most 20 replicas (asked for 80)`))
}

func runtimeConvert(u map[string]any, out any) error {
	return runtime.DefaultUnstructuredConverter.FromUnstructured(u, out)
}

// lastLines is the last n lines of s.
func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(len(lines)-n, 0):], "\n")
}
