package controllers

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/yaml"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/promtest"
	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/internal/testenv"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// readRBAC reads a manifest of config/rbac into obj.
func readRBAC(t *testing.T, name string, obj any) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), "config", "rbac", name))
	if err != nil {
		t.Fatalf("failed to read config/rbac/%s: %v", name, err)
	}
	if err := yaml.UnmarshalStrict(data, obj); err != nil {
		t.Fatalf("failed to parse config/rbac/%s: %v", name, err)
	}
}

// bindClusterRole creates role under a name of its own for this test and
// binds it to user.
func bindClusterRole(t *testing.T, g Gomega, role *rbacv1.ClusterRole, user string) {
	t.Helper()
	ctx := context.Background()
	role = role.DeepCopy()
	role.ObjectMeta = metav1.ObjectMeta{Name: user + "-" + role.Name}
	g.Expect(env.Client.Create(ctx, role)).To(Succeed())
	binding := &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: role.Name},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role.Name},
		Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: user}},
	}
	g.Expect(env.Client.Create(ctx, binding)).To(Succeed())
	t.Cleanup(func() {
		_ = env.Client.Delete(context.Background(), binding)
		_ = env.Client.Delete(context.Background(), role)
	})
}

// TestManagerRoleIsEnough runs the manager as a user holding only the
// generated manager-role (config/rbac/role.yaml) through a whole life: a
// consumer bounded, an outage pinned, the policy deleted and everything
// released. The role grants no update where the controller only patches.
func TestManagerRoleIsEnough(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	var role rbacv1.ClusterRole
	readRBAC(t, "role.yaml", &role)
	for _, rule := range role.Rules {
		if slices.Contains(rule.APIGroups, spillwayv1alpha1.GroupVersion.Group) && !slices.Contains(rule.Resources, "dependencypolicies/finalizers") {
			g.Expect(rule.Verbs).NotTo(ContainElement("update"), "%v: the controller patches, it never updates", rule.Resources)
		}
	}

	ns := newNamespace(t)
	name := "spillway-manager-" + ns
	bindClusterRole(t, g, &role, name)
	user, err := env.Environment.AddUser(envtest.User{Name: name, Groups: []string{"system:authenticated"}}, nil)
	g.Expect(err).NotTo(HaveOccurred())

	srv := redistest.Start(t)
	startManagerWithConfig(t, user.Config(), ns, managerRedis(srv), testOptions)
	w := newWorker(t, srv, ns, "search")
	createDeployment(t, ns, "indexer", 4)
	createScaledObject(t, ns, "indexer", deployment("indexer"), ptr.To[int32](1), ptr.To[int32](50))
	pol := createPolicy(t, ns, "search", testSpec("indexer"))
	g.Eventually(replicasOf(ns, "indexer")).Should(Equal("min=1 max=40"))
	g.Eventually(conditionOf(ns, "search", ConditionReady)).Should(Equal("True/Evaluated"))

	w.report(g, minCalls, protocol.Failure)
	g.Eventually(replicasOf(ns, "indexer")).Should(Equal("min=4 max=40"), "pinned")
	g.Eventually(eventReasons(ns, "search")).Should(ContainElements(EventOpened, EventBounded))

	g.Expect(env.Client.Delete(ctx, pol)).To(Succeed())
	g.Eventually(func(g Gomega) {
		err := env.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: "search"}, &spillwayv1alpha1.DependencyPolicy{})
		g.Expect(apierrors.IsNotFound(err)).To(BeTrue())
	}).Should(Succeed())
	g.Expect(replicasOf(ns, "indexer")(g)).To(Equal("min=1 max=50"))
	g.Expect(w.stateLimit()(g)).To(Equal("Closed/40"))
}

// TestMetricsReaderRole: config/rbac ships a ClusterRole that lets a
// scraper get the manager's secure /metrics, and installs it.
func TestMetricsReaderRole(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	var kustomization struct {
		Resources []string `json:"resources"`
	}
	readRBAC(t, "kustomization.yaml", &kustomization)
	g.Expect(kustomization.Resources).To(ContainElement("metrics_reader_role.yaml"))
	var role rbacv1.ClusterRole
	readRBAC(t, "metrics_reader_role.yaml", &role)

	ns := newNamespace(t)
	scraper := "prometheus-" + ns
	review := func() *authorizationv1.SubjectAccessReview {
		r := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
			User:                  scraper,
			NonResourceAttributes: &authorizationv1.NonResourceAttributes{Path: "/metrics", Verb: "get"},
		}}
		g.Expect(env.Client.Create(context.Background(), r)).To(Succeed())
		return r
	}
	g.Expect(review().Status.Allowed).To(BeFalse(), "nobody may scrape without the role")
	bindClusterRole(t, g, &role, scraper)
	g.Eventually(func() bool { return review().Status.Allowed }).Should(BeTrue())
}

// TestManagerRoleReadsOnlyNamedSecrets: the manager role may get Secrets,
// which a Prometheus signal's credentials need, and neither list nor watch
// them; get is enough, since the controller reads the one Secret a policy
// names, uncached. Run as a user holding only the role, the manager reads
// the token and queries a real Prometheus behind an authenticating proxy.
func TestManagerRoleReadsOnlyNamedSecrets(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	var role rbacv1.ClusterRole
	readRBAC(t, "role.yaml", &role)
	var secretRules []rbacv1.PolicyRule
	for _, rule := range role.Rules {
		if slices.Contains(rule.APIGroups, "") {
			secretRules = append(secretRules, rule)
		}
	}
	g.Expect(secretRules).To(HaveLen(1), "one rule for the core group")
	g.Expect(secretRules[0].Resources).To(Equal([]string{"secrets"}))
	g.Expect(secretRules[0].Verbs).To(Equal([]string{"get"}), "get only: no list, no watch")

	ns := newNamespace(t)
	name := "spillway-manager-" + ns
	bindClusterRole(t, g, &role, name)
	user, err := env.Environment.AddUser(envtest.User{Name: name, Groups: []string{"system:authenticated"}}, nil)
	g.Expect(err).NotTo(HaveOccurred())

	prom := promtest.Start(t)
	g.Expect(env.Client.Create(t.Context(), &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "prometheus-credentials"},
		Data:       map[string][]byte{"token": []byte("s3cret")},
	})).To(Succeed())
	srv := redistest.Start(t)
	startManagerWithConfig(t, user.Config(), ns, managerRedis(srv), testOptions)
	spec := prometheusSpec(bearerProxy(t, prom.URL(), "s3cret"))
	spec.Signals.Prometheus.ErrorRatioQuery = "vector(0)"
	spec.Signals.Prometheus.RateQuery = ""
	spec.Signals.Prometheus.CredentialsSecretRef = &spillwayv1alpha1.SecretReference{Name: "prometheus-credentials"}
	createPolicy(t, ns, "search", spec)
	g.Eventually(conditionOf(ns, "search", ConditionSignalsHealthy)).WithTimeout(20 * time.Second).Should(Equal("True/Healthy"))
	g.Eventually(conditionOf(ns, "search", ConditionReady)).Should(Equal("True/Evaluated"))
}
