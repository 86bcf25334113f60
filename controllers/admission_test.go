package controllers

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	. "github.com/onsi/gomega"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/controller-runtime/pkg/webhook"
	"sigs.k8s.io/yaml"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/internal/testenv"
)

// These tests install the validating webhook as the chart does (the chart's
// template is generated from config/webhook/manifests.yaml), with envtest's
// certificates and its URL in place of the Service, and serve it from a
// manager of its own, as a standby replica would.

// installWebhook installs config/webhook/manifests.yaml under a name of the
// test's own (the configuration is cluster-wide) and returns where to serve
// it.
func installWebhook(t testing.TB) *envtest.WebhookInstallOptions {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), "config", "webhook", "manifests.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	cfg := &admissionregistrationv1.ValidatingWebhookConfiguration{}
	if err := yaml.UnmarshalStrict(data, cfg); err != nil {
		t.Fatalf("failed to read the webhook configuration: %v", err)
	}
	cfg.Name = "spillway-" + strings.ToLower(strings.ReplaceAll(t.Name(), "/", "-"))
	opts := &envtest.WebhookInstallOptions{ValidatingWebhooks: []*admissionregistrationv1.ValidatingWebhookConfiguration{cfg}, LocalServingHost: "127.0.0.1"}
	if err := opts.Install(env.Config); err != nil {
		t.Fatalf("failed to install the webhook: %v", err)
	}
	t.Cleanup(func() {
		_ = env.Client.Delete(context.Background(), cfg)
		_ = opts.Cleanup()
	})
	return opts
}

// startWebhook serves the webhook for namespace ns where opts says, from a
// manager that runs no controller.
func startWebhook(t testing.TB, ns string, opts *envtest.WebhookInstallOptions) *testManager {
	t.Helper()
	mgr, err := ctrl.NewManager(env.Config, ctrl.Options{
		Scheme:                 env.Scheme,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Cache:                  cache.Options{DefaultNamespaces: map[string]cache.Config{ns: {}}},
		Controller:             config.Controller{SkipNameValidation: ptr.To(true)},
		WebhookServer: webhook.NewServer(webhook.Options{
			Host: opts.LocalServingHost, Port: opts.LocalServingPort, CertDir: opts.LocalServingCertDir,
		}),
	})
	if err != nil {
		t.Fatalf("failed to create the webhook manager: %v", err)
	}
	mgr.GetWebhookServer().Register(WebhookPath, &webhook.Admission{Handler: &ReplicasValidator{Client: mgr.GetClient(), Mapper: mgr.GetRESTMapper()}})
	ctx, cancel := context.WithCancel(context.Background())
	m := &testManager{cancel: cancel, done: make(chan error, 1)}
	go func() { m.done <- mgr.Start(ctx) }()
	t.Cleanup(func() { m.stop(t) })
	return m
}

// applyDeployment server-side applies the manifest of Deployment name with
// replicas, as a GitOps tool would under manager; dryRun asks the API server
// to admit it without storing it.
func applyDeployment(ns, name string, replicas int32, manager string, dryRun bool) error {
	d := deploymentObj(ns, name, replicas)
	d.TypeMeta = metav1.TypeMeta{APIVersion: "apps/v1", Kind: "Deployment"}
	obj, err := runtimeToUnstructured(d)
	if err != nil {
		return err
	}
	opts := []client.ApplyOption{client.FieldOwner(manager), client.ForceOwnership}
	if dryRun {
		opts = append(opts, client.DryRunAll)
	}
	return env.Client.Apply(context.Background(), client.ApplyConfigurationFromUnstructured(obj), opts...)
}

func runtimeToUnstructured(d *appsv1.Deployment) (*unstructured.Unstructured, error) {
	data, err := yaml.Marshal(d)
	if err != nil {
		return nil, err
	}
	u := &unstructured.Unstructured{}
	if err := yaml.Unmarshal(data, &u.Object); err != nil {
		return nil, err
	}
	unstructured.RemoveNestedField(u.Object, "metadata", "creationTimestamp")
	unstructured.RemoveNestedField(u.Object, "status")
	return u, nil
}

// expectRefused checks that err is the webhook's refusal with want in it.
func expectRefused(g Gomega, err error, want string) {
	g.Expect(err).To(HaveOccurred(), "the API server admitted a change above the bound")
	g.Expect(apierrors.IsForbidden(err)).To(BeTrue(), "want Forbidden, got %v", err)
	g.Expect(err.Error()).To(ContainSubstring(want))
}

// TestWebhookRefusesAboveTheBound runs every kind of request the webhook
// guards against a bound workload and ScaledObject: kubectl scale, an
// update of spec.replicas, server-side applies with Argo CD's and Flux's
// field managers (and with --dry-run=server), a paused ScaledObject and a
// raised maxReplicaCount. Then the webhook's manager stops, and the same
// requests pass: the webhook never blocks a deploy when Spillway is down.
func TestWebhookRefusesAboveTheBound(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	ns := newNamespace(t)
	srv := redistest.Start(t)
	startManager(t, ns, managerRedis(srv), testOptions)
	hook := startWebhook(t, ns, installWebhook(t))

	createDeployment(t, ns, "render", 80)
	createDeployment(t, ns, "thumbs", 3)
	createScaledObject(t, ns, "thumbs", deployment("thumbs"), nil, ptr.To[int32](30))
	spec := testSpec("thumbs")
	render := deploymentConsumer("render")
	render.SlotsPerReplica = 2
	spec.Consumers = append(spec.Consumers, render)
	createPolicy(t, ns, "template-api", spec)
	// 40 slots, 1:1: render 20 calls at 2 per replica, thumbs 20.
	g.Eventually(deploymentReplicas(ns, "render")).Should(Equal(int32(10)))
	g.Eventually(replicasOf(ns, "thumbs")).Should(Equal("min=unset max=20"))
	g.Eventually(func(g Gomega) map[string]string { return getDeployment(g, ns, "render").Labels }).Should(HaveKey(LabelBoundedBy))

	const why = "raise spec.capacity.concurrency of the DependencyPolicy if the dependency can serve more, or the consumer's weight"
	want := "spillway: " + ns + "/template-api serves 40 concurrent calls, render's share is 1/2 of them and render makes 2 per replica, so at most 10 replicas (asked for 80); " + why

	// kubectl scale, through the scale subresource.
	g.Eventually(func(g Gomega) { expectRefused(g, kubectlScale(ns, "render", 80), want) }).Should(Succeed())
	g.Expect(kubectlScale(ns, "render", 8)).To(Succeed(), "below the bound")

	// An update of spec.replicas (kubectl edit). The controller may write
	// the Deployment meanwhile (its record of the replicas): an update from
	// a stale read conflicts, and is read and sent again, as kubectl does.
	g.Eventually(func(g Gomega) {
		d := getDeployment(g, ns, "render")
		d.Spec.Replicas = ptr.To[int32](80)
		expectRefused(g, env.Client.Update(ctx, d, client.FieldOwner("kubectl-edit")), want)
	}).Should(Succeed())

	// A GitOps sync of a manifest above the bound: a sync error that says
	// why, for Argo CD's and Flux's field managers, and with dry-run.
	for _, manager := range []string{"argocd-controller", "kustomize-controller"} {
		expectRefused(g, applyDeployment(ns, "render", 80, manager, false), want)
		expectRefused(g, applyDeployment(ns, "render", 80, manager, true), want)
	}
	g.Expect(applyDeployment(ns, "render", 6, "argocd-controller", true)).To(Succeed(), "a manifest within the bound syncs")

	// A ScaledObject paused above its bound, and a raised maximum.
	g.Eventually(func(g Gomega) {
		so := getScaledObject(g, ns, "thumbs")
		so.Annotations[AnnotationPausedReplicas] = "50"
		expectRefused(g, env.Client.Update(ctx, so), "so at most 20 replicas ("+AnnotationPausedReplicas+" asks for 50)")
	}).Should(Succeed())
	g.Eventually(func(g Gomega) {
		so := getScaledObject(g, ns, "thumbs")
		so.Spec.MaxReplicaCount = ptr.To[int32](80)
		expectRefused(g, env.Client.Update(ctx, so), "so at most 20 replicas (spec.maxReplicaCount asks for 80)")
	}).Should(Succeed())
	g.Eventually(func(g Gomega) {
		so := getScaledObject(g, ns, "thumbs")
		so.Annotations[AnnotationPausedReplicas] = "4"
		g.Expect(env.Client.Update(ctx, so)).To(Succeed(), "paused within the bound")
	}).Should(Succeed())

	// The webhook's manager stops: the same requests pass. Each raises its
	// value above the one before, so that the webhook, were it called,
	// would refuse it. The controller still runs and lowers them again
	// meanwhile: an update is read and sent again on a conflict, as kubectl
	// does, and any other error fails the test.
	hook.stop(t)
	g.Expect(kubectlScale(ns, "render", 80)).To(Succeed())
	g.Expect(updateRetryingConflicts(&appsv1.Deployment{}, ns, "render", func(o client.Object) {
		o.(*appsv1.Deployment).Spec.Replicas = ptr.To[int32](90)
	})).To(Succeed(), "an update of spec.replicas")
	g.Expect(applyDeployment(ns, "render", 100, "argocd-controller", false)).To(Succeed())
	g.Expect(applyDeployment(ns, "render", 110, "kustomize-controller", false)).To(Succeed())
	g.Expect(updateRetryingConflicts(&kedav1alpha1.ScaledObject{}, ns, "thumbs", func(o client.Object) {
		o.(*kedav1alpha1.ScaledObject).Spec.MaxReplicaCount = ptr.To[int32](80)
	})).To(Succeed(), "a raised maxReplicaCount")
	g.Expect(updateRetryingConflicts(&kedav1alpha1.ScaledObject{}, ns, "thumbs", func(o client.Object) {
		o.SetAnnotations(map[string]string{AnnotationPausedReplicas: "50"})
	})).To(Succeed(), "a ScaledObject paused above its bound")
}

// updateRetryingConflicts reads namespace/name into obj, applies mutate and
// updates it, again from a fresh read on a conflict (the controller writes
// the object meanwhile), as kubectl edit does; it returns any other error
// at once.
func updateRetryingConflicts(obj client.Object, namespace, name string, mutate func(client.Object)) error {
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if err := env.Client.Get(context.Background(), types.NamespacedName{Namespace: namespace, Name: name}, obj); err != nil {
			return err
		}
		mutate(obj)
		return env.Client.Update(context.Background(), obj, client.FieldOwner("kubectl-edit"))
	})
}

// TestWebhookRefusesAutoscalersAndStatefulSets runs the refusals the other
// consumer kinds get through the API server: a raised maxReplicas of an HPA
// consumer, a raised maxReplicaCount of a ScaledObject consumer (named
// apart from its Deployment, so that the message is seen to name the
// ScaledObject), and kubectl scale and an update of spec.replicas of a
// StatefulSet consumer. Then the webhook's manager stops and the same
// requests pass.
func TestWebhookRefusesAutoscalersAndStatefulSets(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ctx := context.Background()
	ns := newNamespace(t)
	srv := redistest.Start(t)
	startManager(t, ns, managerRedis(srv), testOptions)
	hook := startWebhook(t, ns, installWebhook(t))

	createDeployment(t, ns, "thumbs", 3)
	createScaledObject(t, ns, "thumbs-scaler", deployment("thumbs"), nil, ptr.To[int32](30))
	createDeployment(t, ns, "reports", 6)
	createHPA(t, ns, "reports-hpa", "reports", ptr.To[int32](2), 50)
	sts := statefulSetObj(ns, "render", 80)
	g.Expect(env.Client.Create(ctx, sts)).To(Succeed())
	spec := testSpec("thumbs-scaler")
	render := spillwayv1alpha1.Consumer{ScaleTargetRef: &spillwayv1alpha1.ScaleTargetRef{Kind: "StatefulSet", Name: "render"}, SlotsPerReplica: 2, Weight: 2}
	spec.Consumers = append(spec.Consumers, hpaConsumer("reports-hpa"), render)
	createPolicy(t, ns, "template-api", spec)
	// 40 slots, 1:1:2: 10 for each autoscaler, 20 calls for render at 2 per
	// replica.
	g.Eventually(replicasOf(ns, "thumbs-scaler")).Should(Equal("min=unset max=10"))
	g.Eventually(hpaReplicasOf(ns, "reports-hpa")).Should(Equal("min=2 max=10"))
	g.Eventually(scaleOf(sts)).Should(Equal(int32(10)))
	g.Eventually(func(g Gomega) map[string]string { return metadataOf(g, sts).GetLabels() }).Should(HaveKey(LabelBoundedBy))

	const why = "; raise spec.capacity.concurrency of the DependencyPolicy if the dependency can serve more, or the consumer's weight"
	prefix := "spillway: " + ns + "/template-api serves 40 concurrent calls, "

	// An HPA's maxReplicas raised above the bound.
	g.Eventually(func(g Gomega) {
		hpa := getHPA(g, ns, "reports-hpa")
		hpa.Spec.MaxReplicas = 70
		expectRefused(g, env.Client.Update(ctx, hpa), prefix+"reports-hpa's share is 1/4 of them and reports-hpa makes 1 per replica, so at most 10 replicas (spec.maxReplicas asks for 70)"+why)
	}).Should(Succeed())
	// A ScaledObject's maxReplicaCount raised above the bound: the message
	// names the ScaledObject, not its Deployment.
	g.Eventually(func(g Gomega) {
		so := getScaledObject(g, ns, "thumbs-scaler")
		so.Spec.MaxReplicaCount = ptr.To[int32](80)
		expectRefused(g, env.Client.Update(ctx, so), prefix+"thumbs-scaler's share is 1/4 of them and thumbs-scaler makes 1 per replica, so at most 10 replicas (spec.maxReplicaCount asks for 80)"+why)
	}).Should(Succeed())
	// A StatefulSet scaled above the bound, through /scale and spec.replicas.
	wantSTS := prefix + "render's share is 2/4 of them and render makes 2 per replica, so at most 10 replicas (asked for 80)" + why
	g.Eventually(func(g Gomega) { expectRefused(g, kubectlScaleObject(sts, 80), wantSTS) }).Should(Succeed())
	g.Eventually(func(g Gomega) {
		got := &appsv1.StatefulSet{}
		g.Expect(env.Client.Get(ctx, client.ObjectKeyFromObject(sts), got)).To(Succeed())
		got.Spec.Replicas = ptr.To[int32](80)
		expectRefused(g, env.Client.Update(ctx, got, client.FieldOwner("kubectl-edit")), wantSTS)
	}).Should(Succeed())
	// Within the bound, all pass.
	g.Expect(kubectlScaleObject(sts, 8)).To(Succeed(), "below the bound")
	g.Expect(updateRetryingConflicts(&autoscalingv2.HorizontalPodAutoscaler{}, ns, "reports-hpa", func(o client.Object) {
		o.(*autoscalingv2.HorizontalPodAutoscaler).Spec.MaxReplicas = 10
	})).To(Succeed(), "an HPA max at the bound")

	// The webhook's manager stops: the same requests pass.
	hook.stop(t)
	g.Expect(updateRetryingConflicts(&autoscalingv2.HorizontalPodAutoscaler{}, ns, "reports-hpa", func(o client.Object) {
		o.(*autoscalingv2.HorizontalPodAutoscaler).Spec.MaxReplicas = 70
	})).To(Succeed(), "a raised maxReplicas")
	g.Expect(updateRetryingConflicts(&kedav1alpha1.ScaledObject{}, ns, "thumbs-scaler", func(o client.Object) {
		o.(*kedav1alpha1.ScaledObject).Spec.MaxReplicaCount = ptr.To[int32](80)
	})).To(Succeed(), "a raised maxReplicaCount")
	g.Expect(kubectlScaleObject(sts, 80)).To(Succeed())
	g.Expect(updateRetryingConflicts(&appsv1.StatefulSet{}, ns, "render", func(o client.Object) {
		o.(*appsv1.StatefulSet).Spec.Replicas = ptr.To[int32](90)
	})).To(Succeed(), "an update of spec.replicas")
}

// TestWebhookIgnoresUnboundWorkloads: a Deployment no policy names is
// scaled and updated freely, with the webhook serving.
func TestWebhookIgnoresUnboundWorkloads(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ns := newNamespace(t)
	startWebhook(t, ns, installWebhook(t))
	createDeployment(t, ns, "free", 3)
	g.Expect(kubectlScale(ns, "free", 500)).To(Succeed())
	g.Expect(applyDeployment(ns, "free", 900, "argocd-controller", false)).To(Succeed())
}

// TestRefusal checks, without a cluster, which asks the webhook refuses and
// what it says: the bound is the consumer's share of the capacity, and a
// request is refused only when it raises a value above it.
func TestRefusal(t *testing.T) {
	render := spillwayv1alpha1.Consumer{ScaleTargetRef: &spillwayv1alpha1.ScaleTargetRef{Kind: "Deployment", Name: "render-workers"}, SlotsPerReplica: 2}
	thumbs := spillwayv1alpha1.Consumer{ScaledObjectName: "thumbs", Weight: 1}
	pol := func(name string, concurrency int32, consumers ...spillwayv1alpha1.Consumer) spillwayv1alpha1.DependencyPolicy {
		return spillwayv1alpha1.DependencyPolicy{
			ObjectMeta: metav1.ObjectMeta{Namespace: "mail", Name: name},
			Spec:       spillwayv1alpha1.DependencyPolicySpec{Capacity: spillwayv1alpha1.Capacity{Concurrency: concurrency}, Consumers: consumers},
		}
	}
	deploy := func(replicas int64) map[string]any {
		return map[string]any{"spec": map[string]any{"replicas": float64(replicas)}}
	}
	renderRef := workloadRef{APIVersion: "apps/v1", Kind: "Deployment", Name: "render-workers"}
	deleting := pol("deleted", 4, render)
	deleting.DeletionTimestamp = &metav1.Time{Time: time.Now()}

	tests := []struct {
		name     string
		policies []spillwayv1alpha1.DependencyPolicy
		check    replicaCheck
		want     string // "" when allowed
	}{{
		name:     "the issue's example",
		policies: []spillwayv1alpha1.DependencyPolicy{pol("template-api", 40, render)},
		check:    workloadCheck(renderRef, deploy(80), deploy(20), "kubectl scale"),
		want:     "spillway: mail/template-api serves 40 concurrent calls and render-workers makes 2 per replica, so at most 20 replicas (asked for 80); raise spec.capacity.concurrency of the DependencyPolicy if the dependency can serve more",
	}, {
		name:     "at the bound",
		policies: []spillwayv1alpha1.DependencyPolicy{pol("template-api", 40, render)},
		check:    workloadCheck(renderRef, deploy(20), deploy(5), "kubectl scale"),
	}, {
		name:     "above the bound but not raised: an unrelated edit the controller has not lowered yet",
		policies: []spillwayv1alpha1.DependencyPolicy{pol("template-api", 40, render)},
		check:    workloadCheck(renderRef, deploy(80), deploy(80), "spec.replicas"),
	}, {
		name:     "a share of several consumers, and the strictest policy",
		policies: []spillwayv1alpha1.DependencyPolicy{pol("loose", 400, render), pol("template-api", 40, render, thumbs)},
		check:    workloadCheck(renderRef, deploy(30), deploy(10), "spec.replicas"),
		want:     "spillway: mail/template-api serves 40 concurrent calls, render-workers's share is 1/2 of them and render-workers makes 2 per replica, so at most 10 replicas (asked for 30); raise spec.capacity.concurrency of the DependencyPolicy if the dependency can serve more, or the consumer's weight",
	}, {
		name:     "a policy being deleted bounds nothing",
		policies: []spillwayv1alpha1.DependencyPolicy{deleting},
		check:    workloadCheck(renderRef, deploy(80), deploy(20), "kubectl scale"),
	}, {
		name:     "another workload of the same name and another kind",
		policies: []spillwayv1alpha1.DependencyPolicy{pol("template-api", 40, render)},
		check:    workloadCheck(workloadRef{APIVersion: "apps/v1", Kind: "StatefulSet", Name: "render-workers"}, deploy(80), deploy(20), "kubectl scale"),
	}, {
		name:     "a paused ScaledObject",
		policies: []spillwayv1alpha1.DependencyPolicy{pol("template-api", 40, thumbs)},
		check: autoscalerCheck(scaledObjectKind, "thumbs",
			map[string]any{"metadata": map[string]any{"annotations": map[string]any{AnnotationPausedReplicas: "50"}}, "spec": map[string]any{"maxReplicaCount": float64(40)}},
			map[string]any{"spec": map[string]any{"maxReplicaCount": float64(40)}}),
		want: "so at most 40 replicas (autoscaling.keda.sh/paused-replicas asks for 50)",
	}, {
		name:     "a ScaledObject's max unset: KEDA's 100",
		policies: []spillwayv1alpha1.DependencyPolicy{pol("template-api", 40, thumbs)},
		check:    autoscalerCheck(scaledObjectKind, "thumbs", map[string]any{"spec": map[string]any{}}, map[string]any{"spec": map[string]any{"maxReplicaCount": float64(40)}}),
		want:     "so at most 40 replicas (spec.maxReplicaCount asks for 100)",
	}, {
		name:     "an HPA's max raised",
		policies: []spillwayv1alpha1.DependencyPolicy{pol("template-api", 40, spillwayv1alpha1.Consumer{HorizontalPodAutoscalerName: "reports"})},
		check:    autoscalerCheck(hpaKind, "reports", map[string]any{"spec": map[string]any{"maxReplicas": float64(70)}}, map[string]any{"spec": map[string]any{"maxReplicas": float64(40)}}),
		want:     "so at most 40 replicas (spec.maxReplicas asks for 70)",
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			got, _ := admissionRefusal(tt.policies, tt.check)
			if tt.want == "" {
				g.Expect(got).To(BeEmpty())
				return
			}
			g.Expect(got).To(ContainSubstring(tt.want))
		})
	}
}
