package controllers

import (
	"errors"
	"fmt"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

func TestReadyCondition(t *testing.T) {
	pub := protocol.Published{State: wire.Ramping, Limit: 10, Epoch: 4}
	tests := []struct {
		name    string
		err     error
		status  metav1.ConditionStatus
		reason  string
		message string
	}{
		{name: "evaluated", status: metav1.ConditionTrue, reason: ReasonEvaluated, message: "Published state Ramping with limit 10 (epoch 4)"},
		{name: "redis down", err: &evalError{reason: ReasonRedisUnavailable, err: errors.New("dial tcp: connection refused")},
			status: metav1.ConditionFalse, reason: ReasonRedisUnavailable, message: "workers keep the limit last published: dial tcp: connection refused"},
		{name: "an unclassified error is Redis", err: errors.New("i/o timeout"), status: metav1.ConditionFalse, reason: ReasonRedisUnavailable, message: "i/o timeout"},
		{name: "wrapped", err: fmt.Errorf("evaluate: %w", &evalError{reason: ReasonStaleEpoch, err: protocol.ErrStaleEpoch}),
			status: metav1.ConditionFalse, reason: ReasonStaleEpoch, message: "newer epoch"},
		{name: "invalid spec", err: &evalError{reason: ReasonInvalidSpec, err: errors.New("invalid spec: ramp: steps must not be empty")},
			status: metav1.ConditionFalse, reason: ReasonInvalidSpec, message: "steps must not be empty"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			c := readyCondition(tt.err, pub)
			g.Expect(c.Type).To(Equal(ConditionReady))
			g.Expect(c.Status).To(Equal(tt.status))
			g.Expect(c.Reason).To(Equal(tt.reason))
			g.Expect(c.Message).To(ContainSubstring(tt.message))
		})
	}
}

func TestBreakerOpenCondition(t *testing.T) {
	until := time.Date(2026, 3, 1, 12, 1, 0, 0, time.UTC)
	tests := []struct {
		state   wire.State
		status  metav1.ConditionStatus
		reason  string
		message string
	}{
		{wire.Open, metav1.ConditionTrue, ReasonFailureRatioExceeded, "until 2026-03-01T12:01:00Z"},
		{wire.HalfOpen, metav1.ConditionTrue, ReasonProbing, "3 probe calls"},
		{wire.Ramping, metav1.ConditionFalse, ReasonBreakerClosed, "closed"},
		{wire.Closed, metav1.ConditionFalse, ReasonBreakerClosed, "closed"},
		{"", metav1.ConditionUnknown, ReasonNotEvaluated, "not been evaluated"},
	}
	for _, tt := range tests {
		t.Run(string(tt.state), func(t *testing.T) {
			g := NewWithT(t)
			c := breakerOpenCondition(tt.state, until, 3)
			g.Expect(c.Type).To(Equal(ConditionBreakerOpen))
			g.Expect(c.Status).To(Equal(tt.status))
			g.Expect(c.Reason).To(Equal(tt.reason))
			g.Expect(c.Message).To(ContainSubstring(tt.message))
		})
	}
}

func TestRampingCondition(t *testing.T) {
	steps := []int64{5, 10, 20, 40}
	tests := []struct {
		state          wire.State
		step           int
		limit, ceiling int64
		status         metav1.ConditionStatus
		reason         string
		message        string
	}{
		{wire.Ramping, 1, 10, 0, metav1.ConditionTrue, ReasonRampInProgress, "Ramp step 2 of 4: limit 10"},
		{wire.Ramping, 1, 0, 0, metav1.ConditionTrue, ReasonRampInProgress, "Ramp step 2 of 4: limit 10"},
		{wire.Ramping, 1, 10, 20, metav1.ConditionTrue, ReasonSteppedBack, "Stepped back: limit 10, below limit 20, whose calls failed more than ramp.stepBack allows; limit 20 is tried again after a longer clean hold (step 2 of 4)"},
		{wire.Ramping, 0, 2, 5, metav1.ConditionTrue, ReasonSteppedBack, "Stepped back: limit 2, below limit 5"},
		{wire.Closed, 3, 40, 0, metav1.ConditionFalse, ReasonRampComplete, "full capacity"},
		{wire.Open, 0, 0, 0, metav1.ConditionFalse, ReasonAwaitingRecovery, "when the breaker closes"},
		{wire.HalfOpen, 0, 3, 0, metav1.ConditionFalse, ReasonAwaitingRecovery, "when the breaker closes"},
		{"", 0, 0, 0, metav1.ConditionUnknown, ReasonNotEvaluated, "not been evaluated"},
	}
	for _, tt := range tests {
		t.Run(string(tt.state)+"/"+tt.reason, func(t *testing.T) {
			g := NewWithT(t)
			c := rampingCondition(tt.state, tt.step, tt.limit, tt.ceiling, steps)
			g.Expect(c.Type).To(Equal(ConditionRamping))
			g.Expect(c.Status).To(Equal(tt.status))
			g.Expect(c.Reason).To(Equal(tt.reason))
			g.Expect(c.Message).To(ContainSubstring(tt.message))
		})
	}
}

func TestConsumersBoundedCondition(t *testing.T) {
	ok := consumerResult{Name: "a", Message: "min=unset max=20"}
	tests := []struct {
		name    string
		results []consumerResult
		status  metav1.ConditionStatus
		reason  string
		message string
	}{
		{name: "no consumers", status: metav1.ConditionTrue, reason: ReasonNoConsumers, message: "no consumers"},
		{name: "all bounded", results: []consumerResult{ok, {Name: "b"}}, status: metav1.ConditionTrue, reason: ReasonBounded, message: "2 consumers bounded"},
		{name: "missing ScaledObject", results: []consumerResult{ok, {Name: "b", Reason: ReasonScaledObjectNotFound, Message: "ScaledObject not found in namespace ns"}},
			status: metav1.ConditionFalse, reason: ReasonScaledObjectNotFound, message: "1 of 2 consumers not bounded: b: ScaledObject not found"},
		{name: "the first failure in spec order gives the reason", results: []consumerResult{
			{Name: "a", Reason: ReasonNoScaleSubresource, Message: "scale target ConfigMap x (v1) has no scale subresource"},
			{Name: "b", Reason: ReasonConflict, Message: "already bounded by DependencyPolicy other"},
		}, status: metav1.ConditionFalse, reason: ReasonNoScaleSubresource, message: "a: scale target ConfigMap x (v1) has no scale subresource; b: already bounded"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			c := consumersBoundedCondition(tt.results)
			g.Expect(c.Type).To(Equal(ConditionConsumersBounded))
			g.Expect(c.Status).To(Equal(tt.status))
			g.Expect(c.Reason).To(Equal(tt.reason))
			g.Expect(c.Message).To(ContainSubstring(tt.message))
		})
	}
}

func TestReadySummary(t *testing.T) {
	evaluated := readyCondition(nil, protocol.Published{State: wire.Closed, Limit: 40, Epoch: 1})
	redisDown := readyCondition(&evalError{reason: ReasonRedisUnavailable, err: errors.New("connection refused")}, protocol.Published{})
	bounded := consumersBoundedCondition([]consumerResult{{Name: "render"}})
	none := consumersBoundedCondition(nil)
	missing := consumersBoundedCondition([]consumerResult{{Name: "render"}, {Name: "thumbs", Reason: ReasonScaledObjectNotFound, Message: "not found"}})
	conflict := consumersBoundedCondition([]consumerResult{{Name: "render", Reason: ReasonConflict, Message: "bounded by other"}})
	notEvaluated := metav1.Condition{Type: ConditionReady, Status: metav1.ConditionUnknown, Reason: ReasonNotEvaluated}
	tests := []struct {
		name      string
		evaluated metav1.Condition
		consumers metav1.Condition
		status    metav1.ConditionStatus
		reason    string
		message   string
	}{
		{"all well", evaluated, bounded, metav1.ConditionTrue, ReasonEvaluated, "Published state Closed with limit 40"},
		{"no consumers", evaluated, none, metav1.ConditionTrue, ReasonEvaluated, "Published state Closed"},
		{"a consumer missing", evaluated, missing, metav1.ConditionFalse, ReasonScaledObjectNotFound, "Published state Closed with limit 40 (epoch 1), but 1 of 2 consumers not bounded: thumbs: not found"},
		{"a conflict", evaluated, conflict, metav1.ConditionFalse, ReasonConflict, "render: bounded by other"},
		{"Redis down comes first", redisDown, missing, metav1.ConditionFalse, ReasonRedisUnavailable, "connection refused"},
		{"not evaluated yet", notEvaluated, missing, metav1.ConditionUnknown, ReasonNotEvaluated, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			c := readySummary(tt.evaluated, tt.consumers)
			g.Expect(c.Type).To(Equal(ConditionReady))
			g.Expect(c.Status).To(Equal(tt.status))
			g.Expect(c.Reason).To(Equal(tt.reason))
			g.Expect(c.Message).To(ContainSubstring(tt.message))
		})
	}
}

func TestStalledAndReleasePendingConditions(t *testing.T) {
	g := NewWithT(t)
	specErr := errors.New("breaker: minCalls must be >= 1, got 0")
	for _, tt := range []struct {
		name    string
		held    protocol.Published
		reason  string
		message []string
	}{
		{name: "nothing in Redis", reason: ReasonInvalidSpec, message: []string{"nothing is published"}},
		{name: "held Open", held: protocol.Published{State: wire.Open, Epoch: 4, HalfOpenProbes: 3}, reason: ReasonLastStateKept,
			message: []string{"keeps the state last published, Open with limit 0 (epoch 4)", "admits 3 calls at a time once the dead-man bound"}},
		{name: "held Ramping", held: protocol.Published{State: wire.Ramping, Limit: 10, Epoch: 5, HalfOpenProbes: 3}, reason: ReasonLastStateKept,
			message: []string{"Ramping with limit 10 (epoch 5)"}},
	} {
		c := stalledCondition(specErr, tt.held)
		g.Expect(c.Type).To(Equal(ConditionStalled), tt.name)
		g.Expect(c.Status).To(Equal(metav1.ConditionTrue), tt.name)
		g.Expect(c.Reason).To(Equal(tt.reason), tt.name)
		g.Expect(c.Message).To(ContainSubstring("minCalls must be >= 1"), tt.name)
		for _, m := range tt.message {
			g.Expect(c.Message).To(ContainSubstring(m), tt.name)
		}
		if tt.held.State == wire.Ramping {
			g.Expect(c.Message).NotTo(ContainSubstring("dead-man"), tt.name)
		}
	}

	var c metav1.Condition

	c = releasePendingCondition(errors.New("dial tcp 127.0.0.1:6379: connection refused"))
	g.Expect(c.Type).To(Equal(ConditionReady))
	g.Expect(c.Status).To(Equal(metav1.ConditionFalse))
	g.Expect(c.Reason).To(Equal(ReasonReleasePending))
	g.Expect(c.Message).To(And(ContainSubstring(AnnotationSkipRedisRelease+"=true"), ContainSubstring("connection refused")))
}

func TestWorkersServedCondition(t *testing.T) {
	v := protocol.Version
	tests := []struct {
		name    string
		fleet   protocol.Fleet
		status  metav1.ConditionStatus
		reason  string
		message []string
	}{
		{name: "no workers", status: metav1.ConditionTrue, reason: ReasonWorkerVersionsServed, message: []string{"by protocol version: none"}},
		{name: "this version and unregistered older calls", fleet: protocol.Fleet{
			Processes: map[protocol.Process]int{{Client: "go", Version: v}: 2}, Calls: 50, CallsByVersion: map[int]int64{v: 20},
		}, status: metav1.ConditionTrue, reason: ReasonWorkerVersionsServed, message: []string{fmt.Sprintf("v%d: 2 go; v4: 30 calls/min (unregistered)", v)}},
		{name: "one version newer is served", fleet: protocol.Fleet{
			Processes: map[protocol.Process]int{{Client: "python", Version: v + 1}: 1},
		}, status: metav1.ConditionTrue, reason: ReasonWorkerVersionsServed},
		{name: "one version older is served", fleet: protocol.Fleet{
			Processes: map[protocol.Process]int{{Client: "go", Version: v}: 1, {Client: "python", Version: v - 1}: 2},
		}, status: metav1.ConditionTrue, reason: ReasonWorkerVersionsServed, message: []string{fmt.Sprintf("v%d: 1 go; v%d: 2 python", v, v-1)}},
		{name: "two versions older is not", fleet: protocol.Fleet{
			Processes: map[protocol.Process]int{{Client: "go", Version: v - 1}: 1, {Client: "python", Version: v - 2}: 2},
		}, status: metav1.ConditionFalse, reason: ReasonUnservedWorkers, message: []string{
			fmt.Sprintf("2 python process(es) at protocol version %d", v-2), fmt.Sprintf("serves workers at versions %d to %d", v-1, v+1),
			"upgrade their Spillway library", fmt.Sprintf("v%d: 1 go; v%d: 2 python", v-1, v-2)}},
		{name: "two versions newer is not", fleet: protocol.Fleet{
			Processes: map[protocol.Process]int{{Client: "go", Version: v}: 1, {Client: "node", Version: v + 2}: 3},
		}, status: metav1.ConditionFalse, reason: ReasonUnservedWorkers, message: []string{
			fmt.Sprintf("3 node process(es) at protocol version %d", v+2), fmt.Sprintf("serves workers at versions %d to %d", v-1, v+1), "upgrade their Spillway library"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			c := workersServedCondition(tt.fleet)
			g.Expect(c.Type).To(Equal(ConditionWorkersServed))
			g.Expect(c.Status).To(Equal(tt.status))
			g.Expect(c.Reason).To(Equal(tt.reason))
			for _, m := range tt.message {
				g.Expect(c.Message).To(ContainSubstring(m))
			}
		})
	}
}
