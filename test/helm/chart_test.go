package helm

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	appsv1 "k8s.io/api/apps/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/testenv"
)

// crdName is the DependencyPolicy CRD's name.
const crdName = "dependencypolicies.spillway.dev"

func TestLintStrict(t *testing.T) {
	setup(t)
	for _, file := range valuesFiles(t) {
		t.Run(name(file), func(t *testing.T) {
			mustHelm(t, append([]string{"lint", "--strict", chartDir()}, valuesArgs(file)...)...)
		})
	}
}

// TestTemplateServerSideDryRun renders the chart with each values file and
// applies every object to the API server with a server-side dry run: the API
// server validates each against its schema (the CRD's, the ServiceMonitor's)
// and admission, without keeping any.
func TestTemplateServerSideDryRun(t *testing.T) {
	setup(t)
	// What each values file must render, besides what every one does.
	want := map[string]struct{ present, absent []string }{
		"default": {
			present: []string{"CustomResourceDefinition", "PodDisruptionBudget", "Service", "ServiceAccount", "Role", "ValidatingWebhookConfiguration", "Secret"},
			absent:  []string{"ServiceMonitor"},
		},
		"sentinel-values.yaml":    {present: []string{"ServiceMonitor", "CustomResourceDefinition"}},
		"cluster-tls-values.yaml": {present: []string{"ServiceMonitor", "PodDisruptionBudget"}},
		"single-replica-values.yaml": {
			absent: []string{"CustomResourceDefinition", "PodDisruptionBudget", "Service", "ServiceAccount", "Role", "ServiceMonitor", "ValidatingWebhookConfiguration"},
		},
	}
	for _, file := range valuesFiles(t) {
		t.Run(name(file), func(t *testing.T) {
			g := NewWithT(t)
			w, ok := want[name(file)]
			g.Expect(ok).To(BeTrue(), "add %s to this test's table", name(file))
			out := mustHelm(t, append([]string{"template", "spillway", chartDir(), "--namespace", namespace}, valuesArgs(file)...)...)
			objs := objects(t, out)
			var kinds []string
			for _, u := range objs {
				kinds = append(kinds, u.GetKind())
				ac := client.ApplyConfigurationFromUnstructured(u)
				err := k8s.Apply(context.Background(), ac, client.FieldOwner("spillway-helm-test"), client.ForceOwnership, client.DryRunAll)
				g.Expect(err).NotTo(HaveOccurred(), "%s %s", u.GetKind(), u.GetName())
			}
			g.Expect(kinds).To(ContainElements("Deployment", "ClusterRole", "ClusterRoleBinding"))
			g.Expect(kinds).To(ContainElements(w.present))
			for _, kind := range w.absent {
				g.Expect(kinds).NotTo(ContainElement(kind))
			}
		})
	}
}

// TestInstallUpgradeUninstall installs, upgrades and uninstalls releases on
// the API server: a release with crds.keep false takes its CRD with it, one
// with the default crds.keep leaves the CRD and the policies behind.
func TestInstallUpgradeUninstall(t *testing.T) {
	setup(t)
	g := NewWithT(t)
	ctx := context.Background()
	crd := &apiextensionsv1.CustomResourceDefinition{}
	crdKey := client.ObjectKey{Name: crdName}

	// crds.keep: false, in a namespace of its own.
	mustHelm(t, "install", "doomed", chartDir(), "--namespace", "doomed", "--create-namespace", "--set", "crds.keep=false")
	g.Expect(k8s.Get(ctx, crdKey, crd)).To(Succeed())
	g.Expect(crd.Annotations).NotTo(HaveKey("helm.sh/resource-policy"))
	mustHelm(t, "uninstall", "doomed", "--namespace", "doomed")
	g.Eventually(func() bool {
		return apierrors.IsNotFound(k8s.Get(ctx, crdKey, &apiextensionsv1.CustomResourceDefinition{}))
	}).WithTimeout(time.Minute).Should(BeTrue(), "the CRD of a release with crds.keep=false is deleted with it")

	// The defaults.
	mustHelm(t, "install", "spillway", chartDir(), "--namespace", namespace)
	deploy := deployment(t, "spillway")
	g.Expect(*deploy.Spec.Replicas).To(BeEquivalentTo(2))
	args := deploy.Spec.Template.Spec.Containers[0].Args
	g.Expect(args).To(ContainElements("--leader-elect=true", "--redis-addr=redis.spillway-system.svc:6379", "--evaluation-interval=1s"))
	g.Expect(k8s.Get(ctx, crdKey, crd)).To(Succeed())
	g.Expect(crd.Annotations).To(HaveKeyWithValue("helm.sh/resource-policy", "keep"))
	policy := samplePolicy(t)
	g.Eventually(func() error { return k8s.Create(ctx, policy) }).WithTimeout(30*time.Second).Should(Succeed(), "the installed CRD serves DependencyPolicies")

	// Upgrade to Sentinel, three replicas, and a CRD that is not kept: the
	// upgrade changes the Deployment and the CRD alike.
	mustHelm(t, "upgrade", "spillway", chartDir(), "--namespace", namespace,
		"--values", filepath.Join(chartDir(), "ci", "sentinel-values.yaml"),
		"--set", "replicaCount=3", "--set", "crds.keep=false")
	deploy = deployment(t, "spillway")
	g.Expect(*deploy.Spec.Replicas).To(BeEquivalentTo(3))
	args = deploy.Spec.Template.Spec.Containers[0].Args
	g.Expect(args).To(ContainElements("--redis-sentinel-master=mymaster", "--metrics-secure=false",
		"--redis-password-file=/etc/spillway/redis/password/password", "--evaluation-interval=2s"))
	g.Expect(slices.ContainsFunc(args, func(a string) bool { return strings.HasPrefix(a, "--redis-addr") })).To(BeFalse(), "args %v", args)
	g.Expect(k8s.Get(ctx, crdKey, crd)).To(Succeed())
	g.Expect(crd.Annotations).NotTo(HaveKey("helm.sh/resource-policy"))
	monitor := &unstructured.Unstructured{}
	monitor.SetAPIVersion("monitoring.coreos.com/v1")
	monitor.SetKind("ServiceMonitor")
	g.Expect(k8s.Get(ctx, client.ObjectKey{Namespace: namespace, Name: "spillway"}, monitor)).To(Succeed())

	// Back to the defaults.
	mustHelm(t, "upgrade", "spillway", chartDir(), "--namespace", namespace, "--reset-values")
	g.Expect(*deployment(t, "spillway").Spec.Replicas).To(BeEquivalentTo(2))
	g.Expect(k8s.Get(ctx, crdKey, crd)).To(Succeed())
	g.Expect(crd.Annotations).To(HaveKeyWithValue("helm.sh/resource-policy", "keep"))
	g.Expect(apierrors.IsNotFound(k8s.Get(ctx, client.ObjectKeyFromObject(monitor), monitor))).To(BeTrue(), "the ServiceMonitor is gone with serviceMonitor.enabled=false")

	// Uninstall: the manager goes, the CRD and the policy stay.
	mustHelm(t, "uninstall", "spillway", "--namespace", namespace)
	g.Expect(apierrors.IsNotFound(k8s.Get(ctx, client.ObjectKey{Namespace: namespace, Name: "spillway"}, &appsv1.Deployment{}))).To(BeTrue())
	g.Expect(apierrors.IsNotFound(k8s.Get(ctx, client.ObjectKey{Name: "spillway-manager-role"}, &rbacv1.ClusterRole{}))).To(BeTrue())
	g.Consistently(func() error {
		return k8s.Get(ctx, crdKey, &apiextensionsv1.CustomResourceDefinition{})
	}).WithTimeout(3*time.Second).Should(Succeed(), "the CRD survives the uninstall with crds.keep")
	g.Expect(k8s.Get(ctx, client.ObjectKeyFromObject(policy), &spillwayv1alpha1.DependencyPolicy{})).To(Succeed(), "the policy survives the uninstall")
}

// deployment is the manager Deployment of a release in namespace.
func deployment(t *testing.T, name string) *appsv1.Deployment {
	t.Helper()
	d := &appsv1.Deployment{}
	if err := k8s.Get(context.Background(), client.ObjectKey{Namespace: namespace, Name: name}, d); err != nil {
		t.Fatalf("failed to get the Deployment %s: %v", name, err)
	}
	return d
}

// samplePolicy is config/samples' minimal policy, in namespace.
func samplePolicy(t *testing.T) *spillwayv1alpha1.DependencyPolicy {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), "config", "samples", "spillway_v1alpha1_dependencypolicy_minimal.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	p := &spillwayv1alpha1.DependencyPolicy{}
	if err := yaml.UnmarshalStrict(b, p); err != nil {
		t.Fatalf("failed to read the sample policy: %v", err)
	}
	p.Namespace = namespace
	return p
}

// TestSchemaRejectsBadValues checks that values.schema.json (and, for what a
// schema cannot say clearly, the templates) rejects bad values with a message
// that names the value and says what is wrong.
func TestSchemaRejectsBadValues(t *testing.T) {
	setup(t)
	const schema = "values don't meet the specifications of the schema"
	tests := []struct {
		name string
		args []string
		want []string
	}{{
		name: "unknown Redis mode",
		args: []string{"--set", "redis.mode=replicated"},
		want: []string{schema, "at '/redis/mode': value must be one of 'standalone', 'cluster', 'sentinel'"},
	}, {
		name: "wrong type",
		args: []string{"--set-string", "replicaCount=two"},
		want: []string{schema, "at '/replicaCount': got string, want integer"},
	}, {
		name: "misspelt key",
		args: []string{"--set", "redis.adresses={redis:6379}"},
		want: []string{schema, "/redis", "adresses"},
	}, {
		name: "Sentinel without a master",
		args: []string{"--set", "redis.mode=sentinel", "--set", "redis.sentinel.addresses={sentinel:26379}"},
		want: []string{schema, "/redis/sentinel/masterName", "minLength"},
	}, {
		name: "standalone with two addresses",
		args: []string{"--set", "redis.addresses={a:6379,b:6379}"},
		want: []string{schema, "/redis/addresses", "maxItems"},
	}, {
		name: "address without a port",
		args: []string{"--set", "redis.addresses={redis}"},
		want: []string{schema, "/redis/addresses/0", "pattern"},
	}, {
		name: "bad duration",
		args: []string{"--set", "evaluationInterval=1sec"},
		want: []string{schema, "/evaluationInterval", "pattern"},
	}, {
		name: "two replicas without leader election",
		args: []string{"--set", "leaderElection.enabled=false"},
		want: []string{schema, "/replicaCount", "maximum"},
	}, {
		name: "both PodDisruptionBudget bounds",
		args: []string{"--set", "podDisruptionBudget.minAvailable=1", "--set", "podDisruptionBudget.maxUnavailable=1"},
		want: []string{"podDisruptionBudget: set minAvailable or maxUnavailable, not both"},
	}, {
		name: "webhook timeout above the API server's 30s",
		args: []string{"--set", "webhook.timeoutSeconds=60"},
		want: []string{schema, "/webhook/timeoutSeconds", "maximum"},
	}, {
		name: "cert-manager issuer of an unknown kind",
		args: []string{"--set", "webhook.certManager.enabled=true", "--set", "webhook.certManager.issuerRef.name=ca", "--set", "webhook.certManager.issuerRef.kind=Vault"},
		want: []string{schema, "/webhook/certManager/issuerRef/kind"},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			_, errOut, err := helm(append([]string{"template", "spillway", chartDir()}, tt.args...)...)
			g.Expect(err).To(HaveOccurred(), "helm template accepted %v", tt.args)
			for _, w := range tt.want {
				g.Expect(errOut).To(ContainSubstring(w))
			}
		})
	}
}

// TestChartMatchesConfig checks that the chart's CRD and manager ClusterRole
// are those controller-gen writes into config/ ('make manifests').
func TestChartMatchesConfig(t *testing.T) {
	setup(t)
	g := NewWithT(t)
	out := mustHelm(t, "template", "spillway", chartDir(), "--namespace", namespace)
	var chartCRD, chartRole *unstructured.Unstructured
	for _, u := range objects(t, out) {
		switch {
		case u.GetKind() == "CustomResourceDefinition" && u.GetName() == crdName:
			chartCRD = u
		case u.GetKind() == "ClusterRole" && u.GetName() == "spillway-manager-role":
			chartRole = u
		}
	}
	g.Expect(chartCRD).NotTo(BeNil(), "the chart renders no CRD %s", crdName)
	g.Expect(chartRole).NotTo(BeNil(), "the chart renders no ClusterRole spillway-manager-role")

	configCRD := readYAML(t, "config", "crd", "bases", "spillway.dev_dependencypolicies.yaml")
	g.Expect(chartCRD.Object["spec"]).To(Equal(configCRD["spec"]), "the chart's CRD differs from config/crd/bases: run 'make manifests'")
	configRole := readYAML(t, "config", "rbac", "role.yaml")
	g.Expect(chartRole.Object["rules"]).To(Equal(configRole["rules"]), "the chart's manager ClusterRole differs from config/rbac/role.yaml: run 'make manifests'")

	// The webhook's configuration: the same webhooks, calling the release's
	// Service instead of config/'s.
	var chartWebhook *unstructured.Unstructured
	for _, u := range objects(t, out) {
		if u.GetKind() == "ValidatingWebhookConfiguration" {
			chartWebhook = u
		}
	}
	g.Expect(chartWebhook).NotTo(BeNil(), "the chart renders no ValidatingWebhookConfiguration")
	g.Expect(chartWebhook.GetName()).To(Equal("spillway-validating-webhook-configuration"))
	withoutService := func(obj map[string]any) []any {
		hooks, _ := obj["webhooks"].([]any)
		for _, h := range hooks {
			delete(h.(map[string]any)["clientConfig"].(map[string]any), "service")
		}
		return hooks
	}
	configWebhook := readYAML(t, "config", "webhook", "manifests.yaml")
	g.Expect(withoutService(chartWebhook.Object)).To(Equal(withoutService(configWebhook)), "the chart's webhooks differ from config/webhook: run 'make manifests'")
}

// TestWebhookValues renders the webhook with its own certificates (the
// default) and with cert-manager's.
func TestWebhookValues(t *testing.T) {
	setup(t)
	g := NewWithT(t)
	kinds := func(args ...string) map[string]*unstructured.Unstructured {
		out := mustHelm(t, append([]string{"template", "spillway", chartDir(), "--namespace", namespace}, args...)...)
		m := map[string]*unstructured.Unstructured{}
		for _, u := range objects(t, out) {
			m[u.GetKind()+"/"+u.GetName()] = u
		}
		return m
	}
	own := kinds()
	g.Expect(own).To(HaveKey("Secret/spillway-webhook-server-cert"), "the rotation needs the Secret to exist")
	g.Expect(own).To(HaveKey("Role/spillway-webhook-cert"))
	g.Expect(own).To(HaveKey("Service/spillway-webhook-service"))
	args := own["Deployment/spillway"].Object["spec"].(map[string]any)["template"].(map[string]any)["spec"].(map[string]any)["containers"].([]any)[0].(map[string]any)["args"]
	g.Expect(args).To(ContainElements("--webhook", "--webhook-cert-rotation=true",
		"--webhook-cert-secret=spillway-webhook-server-cert", "--webhook-service=spillway-webhook-service",
		"--webhook-configuration=spillway-validating-webhook-configuration"))

	cm := kinds("--set", "webhook.certManager.enabled=true")
	g.Expect(cm).NotTo(HaveKey("Secret/spillway-webhook-server-cert"), "cert-manager writes the Secret")
	g.Expect(cm).To(HaveKey("Certificate/spillway-webhook-server-cert"))
	g.Expect(cm).To(HaveKey("Issuer/spillway-selfsigned"))
	g.Expect(cm["ValidatingWebhookConfiguration/spillway-validating-webhook-configuration"].GetAnnotations()).To(
		HaveKeyWithValue("cert-manager.io/inject-ca-from", namespace+"/spillway-webhook-server-cert"))
	args = cm["Deployment/spillway"].Object["spec"].(map[string]any)["template"].(map[string]any)["spec"].(map[string]any)["containers"].([]any)[0].(map[string]any)["args"]
	g.Expect(args).To(ContainElement("--webhook-cert-rotation=false"))

	off := kinds("--set", "webhook.enabled=false")
	g.Expect(off).NotTo(HaveKey("ValidatingWebhookConfiguration/spillway-validating-webhook-configuration"))
	g.Expect(off).NotTo(HaveKey("Service/spillway-webhook-service"))
}

// readYAML reads a YAML file under the repository's root, as objects reads
// helm's output.
func readYAML(t *testing.T, path ...string) map[string]any {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(append([]string{testenv.RepoRoot()}, path...)...))
	if err != nil {
		t.Fatal(err)
	}
	objs := objects(t, string(b))
	if len(objs) != 1 {
		t.Fatalf("%s holds %d objects, want 1", filepath.Join(path...), len(objs))
	}
	return objs[0].Object
}
