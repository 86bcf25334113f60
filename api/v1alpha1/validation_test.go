package v1alpha1_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	apiextensionsclientset "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/testenv"
)

// env is the kube-apiserver and etcd every test in this package talks to,
// started once in TestMain with the generated CRD installed.
var env *testenv.Env

func TestMain(m *testing.M) {
	testenv.RunTests(m, &env)
}

// newNamespace creates a namespace of its own for one test.
func newNamespace(t *testing.T) string {
	t.Helper()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "dpol-"}}
	if err := env.Client.Create(t.Context(), ns); err != nil {
		t.Fatalf("failed to create namespace: %v", err)
	}
	t.Cleanup(func() {
		_ = env.Client.Delete(context.Background(), ns)
	})
	return ns.Name
}

// policyFromSpec is a DependencyPolicy with the given spec, written in YAML, as
// unstructured content: what kubectl would send, zero values and invalid
// strings included, which the Go types cannot all express.
func policyFromSpec(t *testing.T, namespace, name, spec string) *unstructured.Unstructured {
	t.Helper()
	manifest := fmt.Sprintf("apiVersion: spillway.dev/v1alpha1\nkind: DependencyPolicy\nmetadata:\n  name: %s\n  namespace: %s\n", name, namespace)
	if spec != "" {
		manifest += "spec:\n" + indent(spec, "  ")
	}
	u := &unstructured.Unstructured{}
	if err := yaml.Unmarshal([]byte(manifest), &u.Object); err != nil {
		t.Fatalf("failed to parse manifest %q: %v", manifest, err)
	}
	return u
}

func indent(s, prefix string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	for i, l := range lines {
		lines[i] = prefix + l
	}
	return strings.Join(lines, "\n") + "\n"
}

// sampleFiles are the manifests under config/samples, kustomization.yaml aside.
func sampleFiles(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(testenv.RepoRoot(), "config", "samples", "*.yaml"))
	if err != nil {
		t.Fatalf("failed to list samples: %v", err)
	}
	var samples []string
	for _, f := range files {
		if filepath.Base(f) != "kustomization.yaml" {
			samples = append(samples, f)
		}
	}
	if len(samples) == 0 {
		t.Fatal("no samples found in config/samples")
	}
	return samples
}

// readObjects decodes every YAML document in a file.
func readObjects(t *testing.T, path string) []*unstructured.Unstructured {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("failed to read %s: %v", path, err)
	}
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	var objs []*unstructured.Unstructured
	for {
		u := &unstructured.Unstructured{}
		if err := dec.Decode(&u.Object); err != nil {
			if errors.Is(err, io.EOF) {
				break
			}
			t.Fatalf("failed to decode %s: %v", path, err)
		}
		if len(u.Object) > 0 {
			objs = append(objs, u)
		}
	}
	return objs
}

func TestSamplesAreAccepted(t *testing.T) {
	ns := newNamespace(t)
	for _, path := range sampleFiles(t) {
		t.Run(filepath.Base(path), func(t *testing.T) {
			g := NewWithT(t)
			for _, u := range readObjects(t, path) {
				g.Expect(u.GetKind()).To(Equal(spillwayv1alpha1.DependencyPolicyKind))
				u.SetNamespace(ns)
				g.Expect(env.Client.Create(t.Context(), u)).To(Succeed())

				// Nothing in the sample was dropped on the way in: every field the
				// sample sets is a field of the API (strict decoding), and the
				// server kept each one as written.
				raw, err := json.Marshal(u.Object["spec"])
				g.Expect(err).NotTo(HaveOccurred())
				var want spillwayv1alpha1.DependencyPolicySpec
				g.Expect(yaml.UnmarshalStrict(raw, &want)).To(Succeed(), "sample spec has fields the API does not know")

				var got spillwayv1alpha1.DependencyPolicy
				g.Expect(env.Client.Get(t.Context(), client.ObjectKeyFromObject(u), &got)).To(Succeed())
				g.Expect(got.Spec.Capacity).To(Equal(want.Capacity))
				if want.Ramp.Steps != nil {
					g.Expect(got.Spec.Ramp).To(Equal(want.Ramp))
				}
				if want.Consumers != nil {
					g.Expect(got.Spec.Consumers).To(Equal(want.Consumers))
				}
			}
		})
	}
}

func TestInvalidPoliciesAreRejected(t *testing.T) {
	ns := newNamespace(t)
	// Each case is rejected with an Invalid error whose message names the
	// offending field and says what is wrong with it.
	cases := []struct {
		name string
		spec string
		want []string
	}{{
		name: "ramp steps out of order",
		spec: "capacity: {concurrency: 40}\nramp: {steps: [10, 5, 20]}",
		want: []string{"spec.ramp.steps", "ramp steps must be strictly increasing"},
	}, {
		name: "duplicate ramp steps",
		spec: "capacity: {concurrency: 40}\nramp: {steps: [5, 10, 10, 40]}",
		want: []string{"spec.ramp.steps", "ramp steps must be strictly increasing"},
	}, {
		name: "ramp step above capacity",
		spec: "capacity: {concurrency: 40}\nramp: {steps: [5, 10, 50]}",
		want: []string{"spec.ramp.steps", "every ramp step must be at most capacity.concurrency"},
	}, {
		name: "ramp step 0",
		spec: "capacity: {concurrency: 40}\nramp: {steps: [0, 10, 20]}",
		want: []string{"spec.ramp.steps[0]", "should be greater than or equal to 1"},
	}, {
		name: "empty ramp steps",
		spec: "capacity: {concurrency: 40}\nramp: {steps: []}",
		want: []string{"spec.ramp.steps", "should have at least 1 items"},
	}, {
		name: "stepDuration 0s",
		spec: "capacity: {concurrency: 40}\nramp: {stepDuration: 0s}",
		want: []string{"spec.ramp.stepDuration", "stepDuration must be a duration between 1s and 24h"},
	}, {
		name: "earlyClimb on a fixed schedule",
		spec: "capacity: {concurrency: 40}\nramp: {earlyClimb: true, stepBack: {when: Never}}",
		want: []string{"spec.ramp.earlyClimb", "ramp.earlyClimb needs ramp.stepBack.when Ramping or Always"},
	}, {
		name: "warmFor 0s",
		spec: "capacity: {concurrency: 40}\nramp: {warmFor: 0s}",
		want: []string{"spec.ramp.warmFor", "warmFor must be a duration between 1s and 1h"},
	}, {
		name: "warmFor over an hour",
		spec: "capacity: {concurrency: 40}\nramp: {warmFor: 2h}",
		want: []string{"spec.ramp.warmFor", "warmFor must be a duration between 1s and 1h"},
	}, {
		name: "step-back ratio at the breaker's",
		spec: "capacity: {concurrency: 40}\nramp: {stepBack: {failureRatio: 0.3}}\nbreaker: {failureRatio: 0.3}",
		want: []string{"spec.ramp.stepBack.failureRatio", "ramp.stepBack.failureRatio must be below breaker.failureRatio"},
	}, {
		name: "step-back ratio above the default breaker's",
		spec: "capacity: {concurrency: 40}\nramp: {stepBack: {failureRatio: 0.6}}",
		want: []string{"spec.ramp.stepBack.failureRatio", "ramp.stepBack.failureRatio must be below breaker.failureRatio"},
	}, {
		name: "step-back ratio 0",
		spec: "capacity: {concurrency: 40}\nramp: {stepBack: {failureRatio: 0}}",
		want: []string{"spec.ramp.stepBack.failureRatio", "should be greater than 0"},
	}, {
		name: "step-back minFailures 0",
		spec: "capacity: {concurrency: 40}\nramp: {stepBack: {minFailures: 0}}",
		want: []string{"spec.ramp.stepBack.minFailures", "should be greater than or equal to 1"},
	}, {
		name: "step-back when unknown",
		spec: "capacity: {concurrency: 40}\nramp: {stepBack: {when: Sometimes}}",
		want: []string{"spec.ramp.stepBack.when", "Unsupported value"},
	}, {
		name: "failureRatio 0",
		spec: "capacity: {concurrency: 40}\nbreaker: {failureRatio: 0}",
		want: []string{"spec.breaker.failureRatio", "should be greater than 0"},
	}, {
		name: "failureRatio 1.5",
		spec: "capacity: {concurrency: 40}\nbreaker: {failureRatio: 1.5}",
		want: []string{"spec.breaker.failureRatio", "should be less than or equal to 1"},
	}, {
		name: "minCalls 0",
		spec: "capacity: {concurrency: 40}\nbreaker: {minCalls: 0}",
		want: []string{"spec.breaker.minCalls", "should be greater than or equal to 1"},
	}, {
		name: "breaker window 0s",
		spec: "capacity: {concurrency: 40}\nbreaker: {window: 0s}",
		want: []string{"spec.breaker.window", "window must be a duration between 1s and 1h"},
	}, {
		name: "breaker window above 1h",
		spec: "capacity: {concurrency: 40}\nbreaker: {window: 61m}",
		want: []string{"spec.breaker.window", "window must be a duration between 1s and 1h"},
	}, {
		name: "openDuration negative",
		spec: "capacity: {concurrency: 40}\nbreaker: {openDuration: -5s}",
		want: []string{"spec.breaker.openDuration", "openDuration must be a duration between 1s and 24h"},
	}, {
		name: "halfOpenProbes 0",
		spec: "capacity: {concurrency: 40}\nbreaker: {halfOpenProbes: 0}",
		want: []string{"spec.breaker.halfOpenProbes", "should be greater than or equal to 1"},
	}, {
		name: "retryBudget ratio 0",
		spec: "capacity: {concurrency: 40}\nretryBudget: {ratio: 0}",
		want: []string{"spec.retryBudget.ratio", "should be greater than 0"},
	}, {
		name: "retryBudget ratio above 1",
		spec: "capacity: {concurrency: 40}\nretryBudget: {ratio: 1.2}",
		want: []string{"spec.retryBudget.ratio", "should be less than or equal to 1"},
	}, {
		name: "retryBudget minRetries negative",
		spec: "capacity: {concurrency: 40}\nretryBudget: {minRetries: -1}",
		want: []string{"spec.retryBudget.minRetries", "should be greater than or equal to 0"},
	}, {
		name: "retryBudget window unparsable",
		spec: "capacity: {concurrency: 40}\nretryBudget: {window: abc}",
		want: []string{"spec.retryBudget.window", "window must be a duration between 1s and 1h"},
	}, {
		name: "backoff base 0s",
		spec: "capacity: {concurrency: 40}\nbackoff: {base: 0s}",
		want: []string{"spec.backoff.base", "base must be a duration between 1ms and 24h"},
	}, {
		name: "backoff base above max",
		spec: "capacity: {concurrency: 40}\nbackoff: {base: 10m, max: 5m}",
		want: []string{"spec.backoff", "backoff.base must be at most backoff.max"},
	}, {
		name: "backoff base above defaulted max",
		spec: "capacity: {concurrency: 40}\nbackoff: {base: 10m}",
		want: []string{"spec.backoff", "backoff.base must be at most backoff.max"},
	}, {
		name: "backoff max above 24h",
		spec: "capacity: {concurrency: 40}\nbackoff: {max: 25h}",
		want: []string{"spec.backoff.max", "max must be a duration between 1ms and 24h"},
	}, {
		name: "unknown jitter mode",
		spec: "capacity: {concurrency: 40}\nbackoff: {jitter: Random}",
		want: []string{"spec.backoff.jitter", `Unsupported value: "Random"`},
	}, {
		name: "missing spec",
		spec: "",
		want: []string{"spec", "Required value"},
	}, {
		name: "missing capacity",
		spec: "ramp: {steps: [5, 10]}",
		want: []string{"spec.capacity", "Required value"},
	}, {
		name: "missing capacity.concurrency",
		spec: "capacity: {ratePerSecond: 100}",
		want: []string{"spec.capacity.concurrency", "Required value"},
	}, {
		name: "concurrency 0",
		spec: "capacity: {concurrency: 0}",
		want: []string{"spec.capacity.concurrency", "should be greater than or equal to 1"},
	}, {
		name: "ratePerSecond 0",
		spec: "capacity: {concurrency: 40, ratePerSecond: 0}",
		want: []string{"spec.capacity.ratePerSecond", "should be greater than or equal to 1"},
	}, {
		name: "duplicate consumers",
		spec: "capacity: {concurrency: 40}\nconsumers:\n- {scaledObjectName: workers}\n- {scaledObjectName: workers, weight: 2}",
		want: []string{"spec.consumers", "each consumer appears once"},
	}, {
		name: "consumer slotsPerReplica 0",
		spec: "capacity: {concurrency: 40}\nconsumers:\n- {scaledObjectName: workers, slotsPerReplica: 0}",
		want: []string{"spec.consumers[0].slotsPerReplica", "should be greater than or equal to 1"},
	}, {
		name: "consumer weight 0",
		spec: "capacity: {concurrency: 40}\nconsumers:\n- {scaledObjectName: workers, weight: 0}",
		want: []string{"spec.consumers[0].weight", "should be greater than or equal to 1"},
	}, {
		name: "consumer scaledObjectName not a DNS name",
		spec: "capacity: {concurrency: 40}\nconsumers:\n- {scaledObjectName: Email_Render}",
		want: []string{"spec.consumers[0].scaledObjectName", "should match"},
	}, {
		name: "consumer weight above 1000",
		spec: "capacity: {concurrency: 40}\nconsumers:\n- {scaledObjectName: workers, weight: 1001}",
		want: []string{"spec.consumers[0].weight", "should be less than or equal to 1000"},
	}, {
		name: "consumer slotsPerReplica above 10000",
		spec: "capacity: {concurrency: 40}\nconsumers:\n- {scaledObjectName: workers, slotsPerReplica: 10001}",
		want: []string{"spec.consumers[0].slotsPerReplica", "should be less than or equal to 10000"},
	}, {
		name: "ratePerSecond above 1000000",
		spec: "capacity: {concurrency: 40, ratePerSecond: 1000001}",
		want: []string{"spec.capacity.ratePerSecond", "should be less than or equal to 1000000"},
	}, {
		name: "minCalls above 1000000",
		spec: "capacity: {concurrency: 40}\nbreaker: {minCalls: 1000001}",
		want: []string{"spec.breaker.minCalls", "should be less than or equal to 1000000"},
	}, {
		name: "openDuration above 24h",
		spec: "capacity: {concurrency: 40}\nbreaker: {openDuration: 25h}",
		want: []string{"spec.breaker.openDuration", "openDuration must be a duration between 1s and 24h"},
	}, {
		name: "stepDuration above 24h",
		spec: "capacity: {concurrency: 40}\nramp: {stepDuration: 25h}",
		want: []string{"spec.ramp.stepDuration", "stepDuration must be a duration between 1s and 24h"},
	}, {
		name: "stepDuration unparsable",
		spec: "capacity: {concurrency: 40}\nramp: {stepDuration: 1 minute}",
		want: []string{"spec.ramp.stepDuration", "stepDuration must be a duration between 1s and 24h, such as 1m or 90s"},
	}, {
		name: "breaker window unparsable",
		spec: "capacity: {concurrency: 40}\nbreaker: {window: 30 seconds}",
		want: []string{"spec.breaker.window", "window must be a duration between 1s and 1h"},
	}, {
		name: "openDuration unparsable",
		spec: "capacity: {concurrency: 40}\nbreaker: {openDuration: soon}",
		want: []string{"spec.breaker.openDuration", "openDuration must be a duration between 1s and 24h"},
	}, {
		name: "backoff base unparsable",
		spec: "capacity: {concurrency: 40}\nbackoff: {base: 1sec}",
		want: []string{"spec.backoff.base", "base must be a duration between 1ms and 24h"},
	}, {
		name: "backoff max unparsable",
		spec: "capacity: {concurrency: 40}\nbackoff: {max: five minutes}",
		want: []string{"spec.backoff.max", "max must be a duration between 1ms and 24h"},
	}, {
		name: "consumer naming nothing",
		spec: "capacity: {concurrency: 40}\nconsumers:\n- {weight: 2}",
		want: []string{"spec.consumers[0]", "a consumer names exactly one of scaledObjectName, horizontalPodAutoscalerName and scaleTargetRef"},
	}, {
		name: "consumer naming both a ScaledObject and an HPA",
		spec: "capacity: {concurrency: 40}\nconsumers:\n- {scaledObjectName: workers, horizontalPodAutoscalerName: workers}",
		want: []string{"spec.consumers[0]", "a consumer names exactly one of scaledObjectName, horizontalPodAutoscalerName and scaleTargetRef"},
	}, {
		name: "consumer with empty names",
		spec: "capacity: {concurrency: 40}\nconsumers:\n- {scaledObjectName: '', horizontalPodAutoscalerName: ''}",
		want: []string{"spec.consumers[0]", "a consumer names exactly one of scaledObjectName, horizontalPodAutoscalerName and scaleTargetRef"},
	}, {
		name: "duplicate HPA consumers",
		spec: "capacity: {concurrency: 40}\nconsumers:\n- {horizontalPodAutoscalerName: workers}\n- {horizontalPodAutoscalerName: workers, weight: 2}",
		want: []string{"spec.consumers", "each consumer appears once"},
	}, {
		name: "duplicate scaleTargetRef consumers",
		spec: "capacity: {concurrency: 40}\nconsumers:\n- {scaleTargetRef: {kind: Deployment, name: workers}}\n- {scaleTargetRef: {apiVersion: apps/v1, kind: Deployment, name: workers}, weight: 2}",
		want: []string{"spec.consumers", "each consumer appears once"},
	}, {
		name: "consumer naming an HPA and a scaleTargetRef",
		spec: "capacity: {concurrency: 40}\nconsumers:\n- {horizontalPodAutoscalerName: workers, scaleTargetRef: {kind: Deployment, name: workers}}",
		want: []string{"spec.consumers[0]", "a consumer names exactly one of scaledObjectName, horizontalPodAutoscalerName and scaleTargetRef"},
	}, {
		name: "scaleTargetRef without a kind",
		spec: "capacity: {concurrency: 40}\nconsumers:\n- {scaleTargetRef: {name: workers}}",
		want: []string{"spec.consumers[0].scaleTargetRef.kind", "Required value"},
	}, {
		name: "scaleTargetRef name not a DNS name",
		spec: "capacity: {concurrency: 40}\nconsumers:\n- {scaleTargetRef: {kind: Deployment, name: Render_Workers}}",
		want: []string{"spec.consumers[0].scaleTargetRef.name", "should match"},
	}, {
		name: "consumer horizontalPodAutoscalerName not a DNS name",
		spec: "capacity: {concurrency: 40}\nconsumers:\n- {horizontalPodAutoscalerName: Report_Workers}",
		want: []string{"spec.consumers[0].horizontalPodAutoscalerName", "should match"},
	}}

	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			name := fmt.Sprintf("invalid-%d", i)
			err := env.Client.Create(t.Context(), policyFromSpec(t, ns, name, tc.spec))
			g.Expect(err).To(HaveOccurred(), "the API server accepted an invalid policy")
			t.Logf("rejected: %v", err)
			g.Expect(apierrors.IsInvalid(err)).To(BeTrue(), "want an Invalid error, got %v", err)
			for _, want := range tc.want {
				g.Expect(err.Error()).To(ContainSubstring(want))
			}
			// A rule that fails to evaluate is not a rule that holds, and its
			// error says nothing a person can act on.
			g.Expect(err.Error()).NotTo(ContainSubstring("compilation failed"))
			g.Expect(err.Error()).NotTo(ContainSubstring("no such key"))
			g.Expect(err.Error()).NotTo(ContainSubstring("type conversion"))
			g.Expect(err.Error()).NotTo(ContainSubstring("evaluation error"))

			// Nothing half-valid was stored.
			err = env.Client.Get(t.Context(), types.NamespacedName{Namespace: ns, Name: name}, &spillwayv1alpha1.DependencyPolicy{})
			g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "want NotFound after a rejected create, got %v", err)
		})
	}

	list := &spillwayv1alpha1.DependencyPolicyList{}
	NewWithT(t).Expect(env.Client.List(t.Context(), list, client.InNamespace(ns))).To(Succeed())
	NewWithT(t).Expect(list.Items).To(BeEmpty())
}

func TestDefaults(t *testing.T) {
	g := NewWithT(t)
	ns := newNamespace(t)

	objs := readObjects(t, filepath.Join(testenv.RepoRoot(), "config", "samples", "spillway_v1alpha1_dependencypolicy_minimal.yaml"))
	g.Expect(objs).To(HaveLen(1))
	minimal := objs[0]
	minimal.SetNamespace(ns)
	spec, _, _ := unstructured.NestedMap(minimal.Object, "spec")
	g.Expect(spec).To(HaveLen(1), "the minimal sample sets only capacity")
	// One consumer with only its name, to see its defaults too.
	g.Expect(unstructured.SetNestedSlice(minimal.Object, []any{
		map[string]any{"scaledObjectName": "email-render-workers"},
	}, "spec", "consumers")).To(Succeed())
	g.Expect(env.Client.Create(t.Context(), minimal)).To(Succeed())

	var got spillwayv1alpha1.DependencyPolicy
	g.Expect(env.Client.Get(t.Context(), client.ObjectKeyFromObject(minimal), &got)).To(Succeed())
	g.Expect(got.Spec).To(Equal(spillwayv1alpha1.DependencyPolicySpec{
		Capacity: spillwayv1alpha1.Capacity{Concurrency: 40},
		Ramp: spillwayv1alpha1.Ramp{
			StepDuration: metav1.Duration{Duration: time.Minute},
			StepBack: spillwayv1alpha1.RampStepBack{
				When:         spillwayv1alpha1.StepBackRamping,
				FailureRatio: 0.01,
				MinFailures:  3,
			},
		},
		Breaker: spillwayv1alpha1.Breaker{
			FailureRatio:   0.5,
			MinCalls:       20,
			Window:         metav1.Duration{Duration: 30 * time.Second},
			OpenDuration:   metav1.Duration{Duration: 10 * time.Second},
			HalfOpenProbes: 3,
		},
		RetryBudget: spillwayv1alpha1.RetryBudget{
			Ratio:      0.2,
			MinRetries: ptr.To[int32](10),
			Window:     metav1.Duration{Duration: 60 * time.Second},
		},
		Backoff: spillwayv1alpha1.Backoff{
			Base:   metav1.Duration{Duration: time.Second},
			Max:    metav1.Duration{Duration: 5 * time.Minute},
			Jitter: spillwayv1alpha1.JitterFull,
		},
		Consumers: []spillwayv1alpha1.Consumer{{
			ScaledObjectName: "email-render-workers",
			SlotsPerReplica:  1,
			Weight:           1,
			LimitedBy:        spillwayv1alpha1.LimitedByLibrary,
		}},
		PinMinReplicasDuringOutage: ptr.To(true),
	}))
	// Ramp steps have no server-side default: the controller derives them from
	// capacity.concurrency, so they stay unset.
	g.Expect(got.Spec.Ramp.Steps).To(BeNil())

	// Defaults fill only what is missing: a value that is set is kept.
	partial := policyFromSpec(t, ns, "partial", "capacity: {concurrency: 10}\nbreaker: {minCalls: 5}\nbackoff: {jitter: Equal}")
	g.Expect(env.Client.Create(t.Context(), partial)).To(Succeed())
	g.Expect(env.Client.Get(t.Context(), client.ObjectKeyFromObject(partial), &got)).To(Succeed())
	g.Expect(got.Spec.Breaker.MinCalls).To(Equal(int32(5)))
	g.Expect(got.Spec.Breaker.FailureRatio).To(Equal(0.5))
	g.Expect(got.Spec.Backoff.Jitter).To(Equal(spillwayv1alpha1.JitterEqual))
	g.Expect(got.Spec.Backoff.Base.Duration).To(Equal(time.Second))
}

func TestUpdateToInvalidIsRejected(t *testing.T) {
	g := NewWithT(t)
	ns := newNamespace(t)

	policy := policyFromSpec(t, ns, "template-api", "capacity: {concurrency: 40}\nramp: {steps: [5, 10, 20, 40]}")
	g.Expect(env.Client.Create(t.Context(), policy)).To(Succeed())

	var stored spillwayv1alpha1.DependencyPolicy
	g.Expect(env.Client.Get(t.Context(), client.ObjectKeyFromObject(policy), &stored)).To(Succeed())

	// Lowering the capacity below the last ramp step.
	lowered := stored.DeepCopy()
	lowered.Spec.Capacity.Concurrency = 30
	err := env.Client.Update(t.Context(), lowered)
	g.Expect(apierrors.IsInvalid(err)).To(BeTrue(), "want an Invalid error, got %v", err)
	g.Expect(err.Error()).To(ContainSubstring("spec.ramp.steps"))
	g.Expect(err.Error()).To(ContainSubstring("every ramp step must be at most capacity.concurrency"))

	// The same change as a merge patch, the way kubectl edit or apply sends it.
	patch := client.RawPatch(types.MergePatchType, []byte(`{"spec":{"ramp":{"steps":[20,10]}}}`))
	err = env.Client.Patch(t.Context(), stored.DeepCopy(), patch)
	g.Expect(apierrors.IsInvalid(err)).To(BeTrue(), "want an Invalid error, got %v", err)
	g.Expect(err.Error()).To(ContainSubstring("ramp steps must be strictly increasing"))

	// Nothing changed.
	var after spillwayv1alpha1.DependencyPolicy
	g.Expect(env.Client.Get(t.Context(), client.ObjectKeyFromObject(policy), &after)).To(Succeed())
	g.Expect(after.Spec).To(Equal(stored.Spec))
	g.Expect(after.Generation).To(Equal(stored.Generation))

	// A valid update still goes through.
	raised := after.DeepCopy()
	raised.Spec.Capacity.Concurrency = 80
	g.Expect(env.Client.Update(t.Context(), raised)).To(Succeed())
	g.Expect(raised.Generation).To(Equal(stored.Generation + 1))
}

func TestStatusSubresource(t *testing.T) {
	g := NewWithT(t)
	ns := newNamespace(t)

	policy := policyFromSpec(t, ns, "template-api", "capacity: {concurrency: 40}")
	g.Expect(env.Client.Create(t.Context(), policy)).To(Succeed())
	var stored spillwayv1alpha1.DependencyPolicy
	g.Expect(env.Client.Get(t.Context(), client.ObjectKeyFromObject(policy), &stored)).To(Succeed())

	// A status write that also carries a changed spec: the status client
	// writes only the status.
	now := metav1.NewTime(time.Now().Truncate(time.Second))
	updated := stored.DeepCopy()
	updated.Spec.Capacity.Concurrency = 99
	updated.Status = spillwayv1alpha1.DependencyPolicyStatus{
		ObservedGeneration: stored.Generation,
		State:              spillwayv1alpha1.StateOpen,
		CurrentLimit:       0,
		LastTransitionTime: &now,
		Window:             spillwayv1alpha1.ObservedWindow{Calls: 120, Failures: 90, Retries: 30},
		Conditions: []metav1.Condition{{
			Type:               "Ready",
			Status:             metav1.ConditionFalse,
			Reason:             "BreakerOpen",
			Message:            "90 of 120 calls failed in the last 30s",
			ObservedGeneration: stored.Generation,
			LastTransitionTime: now,
		}},
	}
	g.Expect(env.Client.Status().Update(t.Context(), updated)).To(Succeed())

	var got spillwayv1alpha1.DependencyPolicy
	g.Expect(env.Client.Get(t.Context(), client.ObjectKeyFromObject(policy), &got)).To(Succeed())
	g.Expect(got.Spec).To(Equal(stored.Spec))
	g.Expect(got.Generation).To(Equal(stored.Generation), "a status write must not bump the generation")
	g.Expect(got.Status.State).To(Equal(spillwayv1alpha1.StateOpen))
	g.Expect(got.Status.Window).To(Equal(spillwayv1alpha1.ObservedWindow{Calls: 120, Failures: 90, Retries: 30}))
	g.Expect(got.Status.Conditions).To(HaveLen(1))
	g.Expect(got.Status.Conditions[0].Reason).To(Equal("BreakerOpen"))

	// And the other way round: a write to the main resource ignores status.
	spec := got.DeepCopy()
	spec.Status.State = spillwayv1alpha1.StateClosed
	spec.Spec.Capacity.Concurrency = 50
	g.Expect(env.Client.Update(t.Context(), spec)).To(Succeed())
	g.Expect(env.Client.Get(t.Context(), client.ObjectKeyFromObject(policy), &got)).To(Succeed())
	g.Expect(got.Spec.Capacity.Concurrency).To(Equal(int32(50)))
	g.Expect(got.Status.State).To(Equal(spillwayv1alpha1.StateOpen))

	// The status is validated too.
	bad := got.DeepCopy()
	bad.Status.State = "Broken"
	err := env.Client.Status().Update(t.Context(), bad)
	g.Expect(apierrors.IsInvalid(err)).To(BeTrue(), "want an Invalid error, got %v", err)
	g.Expect(err.Error()).To(ContainSubstring("status.state"))
}

func TestPrinterColumns(t *testing.T) {
	g := NewWithT(t)
	ns := newNamespace(t)

	// The CRD as the API server serves it.
	cs, err := apiextensionsclientset.NewForConfig(env.Config)
	g.Expect(err).NotTo(HaveOccurred())
	crd, err := cs.ApiextensionsV1().CustomResourceDefinitions().Get(t.Context(), "dependencypolicies.spillway.dev", metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(crd.Spec.Names.ShortNames).To(ConsistOf("dpol"))
	g.Expect(crd.Spec.Names.Categories).To(ConsistOf("spillway"))
	g.Expect(crd.Spec.Versions).To(HaveLen(1))
	version := crd.Spec.Versions[0]
	g.Expect(version.Subresources).NotTo(BeNil())
	g.Expect(version.Subresources.Status).NotTo(BeNil())
	var columns []string
	for _, c := range version.AdditionalPrinterColumns {
		columns = append(columns, c.Name+"="+c.JSONPath)
	}
	g.Expect(columns).To(Equal([]string{
		"State=.status.state",
		"Limit=.status.currentLimit",
		"Capacity=.spec.capacity.concurrency",
		`Ready=.status.conditions[?(@.type=="Ready")].status`,
		"Age=.metadata.creationTimestamp",
	}))

	// What 'kubectl get dpol' shows: the server renders the table.
	policy := policyFromSpec(t, ns, "template-api", "capacity: {concurrency: 40}")
	g.Expect(env.Client.Create(t.Context(), policy)).To(Succeed())
	var stored spillwayv1alpha1.DependencyPolicy
	g.Expect(env.Client.Get(t.Context(), client.ObjectKeyFromObject(policy), &stored)).To(Succeed())
	stored.Status = spillwayv1alpha1.DependencyPolicyStatus{
		State:        spillwayv1alpha1.StateRamping,
		CurrentLimit: 10,
		RampStep:     1,
		Conditions: []metav1.Condition{{
			Type:               "Ready",
			Status:             metav1.ConditionTrue,
			Reason:             "Ramping",
			Message:            "ramp step 2 of 4",
			LastTransitionTime: metav1.Now(),
		}},
	}
	g.Expect(env.Client.Status().Update(t.Context(), &stored)).To(Succeed())

	raw, err := cs.Discovery().RESTClient().Get().
		AbsPath("/apis/spillway.dev/v1alpha1/namespaces", ns, "dependencypolicies").
		SetHeader("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io").
		DoRaw(t.Context())
	g.Expect(err).NotTo(HaveOccurred())
	var table metav1.Table
	g.Expect(json.Unmarshal(raw, &table)).To(Succeed())
	var names []string
	for _, c := range table.ColumnDefinitions {
		names = append(names, c.Name)
	}
	g.Expect(names).To(Equal([]string{"Name", "State", "Limit", "Capacity", "Ready", "Age"}))
	g.Expect(table.Rows).To(HaveLen(1))
	cells := table.Rows[0].Cells
	g.Expect(cells[:5]).To(Equal([]any{"template-api", "Ramping", float64(10), float64(40), "True"}))
}

// A policy built in Go that leaves everything but the capacity unset gets the
// documented defaults, also for a capacity below the default probe count (the
// controller admits min(halfOpenProbes, capacity) probes).
func TestTypedCreateGetsDefaults(t *testing.T) {
	g := NewWithT(t)
	ns := newNamespace(t)
	p := &spillwayv1alpha1.DependencyPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "tiny"},
		Spec:       spillwayv1alpha1.DependencyPolicySpec{Capacity: spillwayv1alpha1.Capacity{Concurrency: 2}},
	}
	g.Expect(env.Client.Create(t.Context(), p)).To(Succeed())
	g.Expect(p.Spec.Breaker.HalfOpenProbes).To(Equal(int32(3)))
	g.Expect(p.Spec.Backoff.Max.Duration).To(Equal(5 * time.Minute))
	g.Expect(p.Spec.Ramp.StepDuration.Duration).To(Equal(time.Minute))
	g.Expect(p.Spec.Ramp.StepBack).To(Equal(spillwayv1alpha1.RampStepBack{When: spillwayv1alpha1.StepBackRamping, FailureRatio: 0.01, MinFailures: 3}))
}

// Every maximum is accepted, and so are durations however Go writes them:
// the limits refuse only what is out of range.
func TestMaximaAreAccepted(t *testing.T) {
	g := NewWithT(t)
	ns := newNamespace(t)
	spec := `capacity: {concurrency: 2147483647, ratePerSecond: 1000000}
ramp: {stepDuration: 24h0m0s, stepBack: {when: Always, failureRatio: 0.49, minFailures: 1000000}}
breaker: {minCalls: 1000000, window: 1h, openDuration: 23h59m60s}
retryBudget: {window: 0.5h}
backoff: {base: 1.5ms, max: 24h}
consumers:
- {scaledObjectName: a, weight: 1000, slotsPerReplica: 10000}
- {scaledObjectName: b, weight: 1000, slotsPerReplica: 10000}
- {scaledObjectName: c, weight: 1000, slotsPerReplica: 10000}
- {horizontalPodAutoscalerName: d, weight: 1000, slotsPerReplica: 10000}
- {scaleTargetRef: {apiVersion: argoproj.io/v1alpha1, kind: Rollout, name: e}, weight: 1000, slotsPerReplica: 10000}`
	g.Expect(env.Client.Create(t.Context(), policyFromSpec(t, ns, "maxima", spec))).To(Succeed())
}

// A ScaledObject and an HPA may share a name: they are different objects.
// A manifest written before HPAs could be consumers, naming only
// scaledObjectName, reads back the same, with the HPA's name empty.
func TestConsumersOfBothKinds(t *testing.T) {
	g := NewWithT(t)
	ns := newNamespace(t)
	spec := `capacity: {concurrency: 40}
consumers:
- scaledObjectName: workers
  slotsPerReplica: 2
- horizontalPodAutoscalerName: workers
  weight: 3`
	pol := policyFromSpec(t, ns, "both", spec)
	g.Expect(env.Client.Create(t.Context(), pol)).To(Succeed())
	var got spillwayv1alpha1.DependencyPolicy
	g.Expect(env.Client.Get(t.Context(), client.ObjectKeyFromObject(pol), &got)).To(Succeed())
	g.Expect(got.Spec.Consumers).To(Equal([]spillwayv1alpha1.Consumer{
		{ScaledObjectName: "workers", SlotsPerReplica: 2, Weight: 1, LimitedBy: spillwayv1alpha1.LimitedByLibrary},
		{HorizontalPodAutoscalerName: "workers", SlotsPerReplica: 1, Weight: 3, LimitedBy: spillwayv1alpha1.LimitedByLibrary},
	}))

	// The list is atomic (a scaleTargetRef, a struct, cannot be a list-map
	// key): a second manager's apply of another list conflicts with the
	// first manager's, instead of silently dropping its consumers, and,
	// forced, replaces the whole list.
	add := policyFromSpec(t, ns, "both", "capacity: {concurrency: 40}\nconsumers:\n- {horizontalPodAutoscalerName: reports}\n- {scaleTargetRef: {kind: Deployment, name: workers}}")
	err := env.Client.Apply(t.Context(), client.ApplyConfigurationFromUnstructured(add), client.FieldOwner("second"))
	g.Expect(apierrors.IsConflict(err)).To(BeTrue(), "want a conflict over spec.consumers, got %v", err)
	g.Expect(env.Client.Apply(t.Context(), client.ApplyConfigurationFromUnstructured(add), client.FieldOwner("second"), client.ForceOwnership)).To(Succeed())
	g.Expect(env.Client.Get(t.Context(), client.ObjectKeyFromObject(pol), &got)).To(Succeed())
	g.Expect(got.Spec.Consumers).To(Equal([]spillwayv1alpha1.Consumer{
		{HorizontalPodAutoscalerName: "reports", SlotsPerReplica: 1, Weight: 1, LimitedBy: spillwayv1alpha1.LimitedByLibrary},
		{ScaleTargetRef: &spillwayv1alpha1.ScaleTargetRef{APIVersion: "apps/v1", Kind: "Deployment", Name: "workers"}, SlotsPerReplica: 1, Weight: 1, LimitedBy: spillwayv1alpha1.LimitedByLibrary},
	}), "the scaleTargetRef's apiVersion defaults to apps/v1")
}
