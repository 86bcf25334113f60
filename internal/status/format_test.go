package status

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	. "github.com/onsi/gomega"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/controllers"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

var now = time.Date(2026, 12, 4, 16, 0, 0, 0, time.UTC)

// testPolicy is a policy of capacity 40, ramp 5, 10, 20, 40, in state at
// step with ceiling, whose state changed age ago.
func testPolicy(state spillwayv1alpha1.DependencyState, limit, step, ceiling int32, age time.Duration, ready metav1.Condition, consumers ...spillwayv1alpha1.Consumer) *spillwayv1alpha1.DependencyPolicy {
	return &spillwayv1alpha1.DependencyPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: "mail", Name: "template-api"},
		Spec: spillwayv1alpha1.DependencyPolicySpec{
			Capacity:  spillwayv1alpha1.Capacity{Concurrency: 40},
			Ramp:      spillwayv1alpha1.Ramp{Steps: []int32{5, 10, 20, 40}},
			Consumers: consumers,
		},
		Status: spillwayv1alpha1.DependencyPolicyStatus{
			State: state, CurrentLimit: limit, RampStep: step, RampCeiling: ceiling,
			LastTransitionTime: &metav1.Time{Time: now.Add(-age)},
			Conditions:         []metav1.Condition{ready},
		},
	}
}

// with adds conditions to pol's status.
func with(pol *spillwayv1alpha1.DependencyPolicy, conds ...metav1.Condition) *spillwayv1alpha1.DependencyPolicy {
	pol.Status.Conditions = append(pol.Status.Conditions, conds...)
	return pol
}

func cond(t, reason, msg string) metav1.Condition {
	return metav1.Condition{Type: t, Status: metav1.ConditionTrue, Reason: reason, Message: msg}
}

func readyTrue(msg string) metav1.Condition {
	return metav1.Condition{Type: controllers.ConditionReady, Status: metav1.ConditionTrue, Reason: controllers.ReasonEvaluated, Message: msg}
}

func so(name string, max int32, ann map[string]string) *kedav1alpha1.ScaledObject {
	return &kedav1alpha1.ScaledObject{
		ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: ann},
		Spec:       kedav1alpha1.ScaledObjectSpec{MaxReplicaCount: &max},
	}
}

// TestTableCells: each row's cells, from the policy, its autoscalers and
// Redis (nil: unreachable).
func TestTableCells(t *testing.T) {
	owned := map[string]string{controllers.AnnotationOwner: "template-api"}
	pinned := map[string]string{controllers.AnnotationOwner: "template-api", controllers.AnnotationPinnedMinReplicas: "6"}
	soConsumer := spillwayv1alpha1.Consumer{ScaledObjectName: "render"}
	hpaConsumer := spillwayv1alpha1.Consumer{HorizontalPodAutoscalerName: "render-hpa"}
	published := func(state wire.State, limit int64) *protocol.Published {
		return &protocol.Published{State: state, Limit: limit, Epoch: 3, BreakerWindow: 30 * time.Second, UpdatedAt: now.Add(-time.Second)}
	}
	window := protocol.Window{Calls: 300, Failures: 20, Timeouts: 10, ByAttempt: [4]int64{240, 50, 10, 0}}
	tests := []struct {
		name      string
		pol       *spillwayv1alpha1.DependencyPolicy
		as        Autoscalers
		published *protocol.Published // nil: Redis unreachable
		inFlight  int64
		window    protocol.Window
		want      []string
		wantWide  []string
	}{{
		name:      "Closed, bound consumer, no reason",
		pol:       testPolicy(spillwayv1alpha1.StateClosed, 40, 3, 0, 90*time.Minute, readyTrue("Published state Closed with limit 40 (epoch 2)"), soConsumer),
		as:        Autoscalers{ScaledObjects: map[string]*kedav1alpha1.ScaledObject{"render": so("render", 20, owned)}},
		published: published(wire.Closed, 40), inFlight: 17, window: window,
		want:     []string{"template-api", "Closed", "40/40", "-", "17", "10.0", "10.0%", "20.0%", "?", "max 20", "90m", "-"},
		wantWide: []string{"Closed 40 epoch 3, 1s ago", "?", "-"},
	}, {
		name: "Open, pinned consumer, Ready's reason",
		pol: with(testPolicy(spillwayv1alpha1.StateOpen, 0, 0, 0, 2*time.Minute, readyTrue("Published state Open with limit 0 (epoch 3)"), soConsumer),
			cond(controllers.ConditionBreakerOpen, controllers.ReasonFailureRatioExceeded, "The breaker is open"),
			cond(controllers.ConditionRamping, controllers.ReasonAwaitingRecovery, "The ramp starts from its first step when the breaker closes")),
		as:        Autoscalers{ScaledObjects: map[string]*kedav1alpha1.ScaledObject{"render": so("render", 20, pinned)}},
		published: published(wire.Open, 0),
		want:      []string{"template-api", "Open", "0/40", "-", "0", "0.0", "-", "-", "?", "max 20 min 6", "2m", "FailureRatioExceeded"},
		wantWide:  []string{"Open 0 epoch 3, 1s ago", "?", "The breaker is open"},
	}, {
		name: "Ramping with a ceiling",
		pol: with(testPolicy(spillwayv1alpha1.StateRamping, 10, 1, 20, 30*time.Second, readyTrue("Published state Ramping with limit 10 (epoch 4)")),
			cond(controllers.ConditionBreakerOpen, controllers.ReasonBreakerClosed, "The breaker is closed"),
			cond(controllers.ConditionRamping, controllers.ReasonSteppedBack, "Stepped back: limit 10, below limit 20")),
		published: published(wire.Ramping, 10), inFlight: 9, window: protocol.Window{Calls: 60, ByAttempt: [4]int64{60}},
		want:     []string{"template-api", "Ramping", "10/40", "2/4 ceiling 20", "9", "2.0", "0.0%", "0.0%", "?", "-", "30s", "SteppedBack"},
		wantWide: []string{"Ramping 10 epoch 3, 1s ago", "?", "Stepped back: limit 10, below limit 20"},
	}, {
		name: "unbound consumers: not found, another policy's, kind not served; Ready False",
		pol: testPolicy(spillwayv1alpha1.StateClosed, 40, 3, 0, time.Hour,
			metav1.Condition{Type: controllers.ConditionReady, Status: metav1.ConditionFalse, Reason: controllers.ReasonScaledObjectNotFound, Message: "but 1 of 3 consumers not bounded"},
			soConsumer, spillwayv1alpha1.Consumer{ScaledObjectName: "other"}, hpaConsumer),
		as: Autoscalers{
			ScaledObjects: map[string]*kedav1alpha1.ScaledObject{"other": so("other", 7, map[string]string{controllers.AnnotationOwner: "payments"})},
			HPAsErr:       errors.New("forbidden"),
		},
		published: published(wire.Closed, 40),
		want:      []string{"template-api", "Closed", "40/40", "-", "0", "0.0", "-", "-", "?", "unbound, unbound, unbound", "60m", "ScaledObjectNotFound"},
		wantWide:  []string{"Closed 40 epoch 3, 1s ago", "?", "but 1 of 3 consumers not bounded"},
	}, {
		name: "Redis unreachable: the cluster's columns, ? for Redis's",
		pol: with(testPolicy(spillwayv1alpha1.StateRamping, 5, 0, 0, 10*time.Second, readyTrue("x"), hpaConsumer),
			cond(controllers.ConditionRamping, controllers.ReasonRampInProgress, "Ramp step 1 of 4: limit 5")),
		as: Autoscalers{HPAs: map[string]*autoscalingv2.HorizontalPodAutoscaler{"render-hpa": {
			ObjectMeta: metav1.ObjectMeta{Name: "render-hpa", Annotations: pinned},
			Spec:       autoscalingv2.HorizontalPodAutoscalerSpec{MaxReplicas: 8},
		}}},
		want:     []string{"template-api", "Ramping", "5/40", "1/4", "?", "?", "?", "?", "?", "max 8 min 6", "10s", "RampInProgress"},
		wantWide: []string{"?", "?", "Ramp step 1 of 4: limit 5"},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			row := FromCluster(tt.pol, tt.as)
			if tt.published != nil {
				row = WithRedis(row, *tt.published, true, tt.inFlight, tt.window)
			}
			g.Expect(tableCells(row, now, false)).To(Equal(tt.want))
			if tt.wantWide != nil {
				g.Expect(tableCells(row, now, true)[len(tt.want):]).To(Equal(tt.wantWide))
			}
		})
	}
}

// TestConsumersWide: wide names each consumer and says why it is not bound.
func TestConsumersWide(t *testing.T) {
	g := NewWithT(t)
	pol := testPolicy(spillwayv1alpha1.StateClosed, 40, 3, 0, time.Hour, readyTrue(""),
		spillwayv1alpha1.Consumer{ScaledObjectName: "render"},
		spillwayv1alpha1.Consumer{ScaledObjectName: "other"},
		spillwayv1alpha1.Consumer{ScaledObjectName: "gone"},
		spillwayv1alpha1.Consumer{HorizontalPodAutoscalerName: "h"},
		spillwayv1alpha1.Consumer{ScaleTargetRef: &spillwayv1alpha1.ScaleTargetRef{Kind: "Deployment", Name: "mailer"}},
		spillwayv1alpha1.Consumer{ScaleTargetRef: &spillwayv1alpha1.ScaleTargetRef{Kind: "StatefulSet", Name: "gone"}})
	mailer := &unstructured.Unstructured{Object: map[string]any{"spec": map[string]any{"replicas": int64(10)}}}
	mailer.SetAnnotations(map[string]string{controllers.AnnotationOwner: "template-api"})
	row := FromCluster(pol, Autoscalers{
		Workloads: map[string]*unstructured.Unstructured{"Deployment/mailer": mailer},
		ScaledObjects: map[string]*kedav1alpha1.ScaledObject{
			"render": so("render", 20, map[string]string{controllers.AnnotationOwner: "template-api"}),
			"other":  so("other", 7, map[string]string{controllers.AnnotationOwner: "payments"}),
		},
		HPAs: map[string]*autoscalingv2.HorizontalPodAutoscaler{"h": {ObjectMeta: metav1.ObjectMeta{Name: "h"}}},
	})
	g.Expect(consumersCell(row.Consumers, true)).To(Equal(
		"so/render max 20, so/other bound by policy payments, so/gone not found, hpa/h not bound, deploy/mailer replicas 10, sts/gone not found"))
}

// TestWrite: the table's header and the Redis note, and JSON and YAML that
// decode back to the report.
func TestWrite(t *testing.T) {
	row := FromCluster(with(testPolicy(spillwayv1alpha1.StateOpen, 0, 0, 0, time.Minute, readyTrue("m")),
		cond(controllers.ConditionBreakerOpen, controllers.ReasonProbing, "probing")), Autoscalers{})
	rep := Report{Time: metav1.Time{Time: now}, Items: []Row{row}, RedisUnreachable: "Redis at 127.0.0.1:1: connection refused"}
	t.Run("table", func(t *testing.T) {
		g := NewWithT(t)
		var b bytes.Buffer
		g.Expect(Write(&b, rep, OutputTable, true)).To(Succeed())
		lines := strings.Split(strings.TrimSpace(b.String()), "\n")
		g.Expect(lines).To(HaveLen(3))
		g.Expect(strings.Fields(lines[0])).To(Equal([]string{"NAMESPACE", "NAME", "STATE", "LIMIT/CAPACITY", "RAMP", "IN", "FLIGHT", "CALLS/s", "FAIL%", "RETRY%", "PROTOCOLS", "CONSUMERS", "AGE", "REASON"}))
		g.Expect(strings.Fields(lines[1])).To(Equal([]string{"mail", "template-api", "Open", "0/40", "-", "?", "?", "?", "?", "?", "-", "60s", "Probing"}))
		g.Expect(lines[2]).To(Equal("Redis was unreachable, so IN FLIGHT, CALLS/s, FAIL% and RETRY% are unknown (?): Redis at 127.0.0.1:1: connection refused"))
	})
	t.Run("no policies", func(t *testing.T) {
		g := NewWithT(t)
		var b bytes.Buffer
		g.Expect(Write(&b, Report{}, OutputWide, false)).To(Succeed())
		g.Expect(b.String()).To(Equal("No DependencyPolicies found.\n"))
	})
	for _, format := range []string{OutputJSON, OutputYAML} {
		t.Run(format, func(t *testing.T) {
			g := NewWithT(t)
			var b bytes.Buffer
			g.Expect(Write(&b, rep, format, false)).To(Succeed())
			var back Report
			if format == OutputJSON {
				g.Expect(json.Unmarshal(b.Bytes(), &back)).To(Succeed())
			} else {
				g.Expect(yaml.UnmarshalStrict(b.Bytes(), &back)).To(Succeed())
			}
			g.Expect(back.Time.Equal(&rep.Time)).To(BeTrue())
			back.Time = rep.Time
			back.Items[0].LastTransitionTime = rep.Items[0].LastTransitionTime
			g.Expect(back).To(Equal(rep))
		})
	}
	t.Run("unknown format", func(t *testing.T) {
		g := NewWithT(t)
		g.Expect(Write(&bytes.Buffer{}, rep, "xml", false)).To(MatchError(ContainSubstring(`unknown output format "xml"`)))
	})
}

// TestProtocolCells: the workers' protocol versions, newest first, and per
// client with -o wide.
func TestProtocolCells(t *testing.T) {
	g := NewWithT(t)
	row := Row{}
	g.Expect(protocolsCell(row)).To(Equal("?"))
	g.Expect(workersCell(row)).To(Equal("?"))
	row = WithRedis(row, protocol.Published{State: "Closed"}, true, 0, protocol.Window{})
	g.Expect(protocolsCell(row)).To(Equal("?"), "not read yet")
	row = WithFleet(row, protocol.Fleet{})
	g.Expect(protocolsCell(row)).To(Equal("-"))
	g.Expect(workersCell(row)).To(Equal("none"))
	row = WithFleet(row, protocol.Fleet{
		Processes:      map[protocol.Process]int{{Client: "go", Version: 5}: 3, {Client: "python", Version: 5}: 1},
		Calls:          130,
		CallsByVersion: map[int]int64{5: 10},
	})
	g.Expect(protocolsCell(row)).To(Equal("5,4"))
	g.Expect(workersCell(row)).To(Equal("v5: 3 go, 1 python; v4: 120 calls/min (unregistered)"))
}

// TestParseFlags: kubectl's flags, names among them, and the checks.
func TestParseFlags(t *testing.T) {
	tests := []struct {
		args    []string
		want    func(*Flags)
		wantErr string
	}{
		{args: nil, want: func(f *Flags) {}},
		{args: []string{"-n", "mail", "-o", "wide", "template-api", "--watch"}, want: func(f *Flags) {
			f.Namespace, f.Output, f.Watch, f.Names = "mail", "wide", true, []string{"template-api"}
		}},
		{args: []string{"--all-namespaces", "--output=json", "--context", "kind-a", "--kubeconfig", "/k"}, want: func(f *Flags) {
			f.AllNamespaces, f.Output, f.Context, f.Kubeconfig = true, "json", "kind-a", "/k"
		}},
		{args: []string{"-o", "table"}, wantErr: `unknown output format "table"`},
		{args: []string{"-A", "x"}, wantErr: "cannot be given with --all-namespaces"},
		{args: []string{"--redis-addr", "a:1,b:2"}, wantErr: "set --redis-cluster"},
		{args: []string{"--redis-sentinel-master", "m"}, wantErr: "needs --redis-sentinel-addr"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			g := NewWithT(t)
			f, err := ParseFlags("status", tt.args, &bytes.Buffer{})
			if tt.wantErr != "" {
				g.Expect(err).To(MatchError(ContainSubstring(tt.wantErr)))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			want := Flags{WatchInterval: 2 * time.Second}
			tt.want(&want)
			g.Expect(f.Namespace).To(Equal(want.Namespace))
			g.Expect(f.AllNamespaces).To(Equal(want.AllNamespaces))
			g.Expect(f.Output).To(Equal(want.Output))
			g.Expect(f.Watch).To(Equal(want.Watch))
			g.Expect(f.Names).To(Equal(want.Names))
			g.Expect(f.Context).To(Equal(want.Context))
			g.Expect(f.Kubeconfig).To(Equal(want.Kubeconfig))
			g.Expect(f.Redis.Addrs).To(Equal([]string{"127.0.0.1:6379"}))
		})
	}
}
