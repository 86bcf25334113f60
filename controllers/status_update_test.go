package controllers

import (
	"errors"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/meta"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// TestUpdateStatus drives updateStatus, without a cluster, through the three
// kinds of reconcile: a valid policy, an invalid spec and a deletion.
func TestUpdateStatus(t *testing.T) {
	at := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	published := protocol.Published{State: wire.Open, Limit: 0, Capacity: 40, Epoch: 3,
		BreakerSince: at.Add(-time.Minute), OpenUntil: at.Add(time.Minute)}
	policyAt := func(gen int64) *spillwayv1alpha1.DependencyPolicy {
		pol := &spillwayv1alpha1.DependencyPolicy{}
		pol.Generation = gen
		pol.Status.ObservedGeneration = 1
		return pol
	}
	bounded := []consumerResult{{Name: "render", Message: "min=1 max=20"}}
	status := func(pol *spillwayv1alpha1.DependencyPolicy, condType string) string {
		c := meta.FindStatusCondition(pol.Status.Conditions, condType)
		if c == nil {
			return "absent"
		}
		return string(c.Status) + "/" + c.Reason
	}

	t.Run("a published evaluation of this generation", func(t *testing.T) {
		g := NewWithT(t)
		pol := policyAt(2)
		meta.SetStatusCondition(&pol.Status.Conditions, stalledCondition(errors.New("old"), protocol.Published{}))
		updateStatus(pol, &observed{Evaluated: true, Evaluation: evaluation{Published: published, At: at, Generation: 2},
			Params: seedParams(t), Consumers: bounded})
		g.Expect(pol.Status.State).To(Equal(spillwayv1alpha1.StateOpen))
		g.Expect(pol.Status.ObservedGeneration).To(Equal(int64(2)))
		g.Expect(pol.Status.LastTransitionTime.Time).To(Equal(published.BreakerSince))
		g.Expect(status(pol, ConditionReady)).To(Equal("True/" + ReasonEvaluated))
		g.Expect(status(pol, ConditionConsumersBounded)).To(HavePrefix("True/"))
		g.Expect(status(pol, ConditionBreakerOpen)).To(Equal("True/" + ReasonFailureRatioExceeded))
		g.Expect(status(pol, ConditionStalled)).To(Equal("absent"), "a valid spec is not Stalled")
		for _, c := range pol.Status.Conditions {
			g.Expect(c.ObservedGeneration).To(Equal(int64(2)), c.Type)
		}
	})

	t.Run("an evaluation of an older generation is not observed", func(t *testing.T) {
		g := NewWithT(t)
		pol := policyAt(3)
		updateStatus(pol, &observed{Evaluated: true, Evaluation: evaluation{Published: published, At: at, Generation: 2},
			Params: seedParams(t), Consumers: bounded})
		g.Expect(pol.Status.State).To(Equal(spillwayv1alpha1.StateOpen))
		g.Expect(pol.Status.ObservedGeneration).To(Equal(int64(1)))
	})

	t.Run("a failed evaluation keeps the published status", func(t *testing.T) {
		g := NewWithT(t)
		pol := policyAt(2)
		pol.Status.State = spillwayv1alpha1.StateClosed
		updateStatus(pol, &observed{Evaluated: true, Evaluation: evaluation{Published: published, At: at, Generation: 2,
			Err: &evalError{reason: ReasonRedisUnavailable, err: errors.New("connection refused")}},
			Params: seedParams(t), Consumers: bounded})
		g.Expect(pol.Status.State).To(Equal(spillwayv1alpha1.StateClosed))
		g.Expect(pol.Status.ObservedGeneration).To(Equal(int64(1)))
		g.Expect(status(pol, ConditionReady)).To(Equal("False/" + ReasonRedisUnavailable))
	})

	t.Run("not evaluated yet", func(t *testing.T) {
		g := NewWithT(t)
		pol := policyAt(1)
		updateStatus(pol, &observed{Params: seedParams(t), Consumers: bounded})
		g.Expect(status(pol, ConditionReady)).To(Equal("Unknown/" + ReasonNotEvaluated))
	})

	t.Run("a consumer that cannot be bounded makes Ready False", func(t *testing.T) {
		g := NewWithT(t)
		pol := policyAt(2)
		updateStatus(pol, &observed{Evaluated: true, Evaluation: evaluation{Published: published, At: at, Generation: 2},
			Params: seedParams(t), Consumers: []consumerResult{{Name: "render", Reason: ReasonScaledObjectNotFound, Message: "not found"}}})
		g.Expect(status(pol, ConditionConsumersBounded)).To(Equal("False/" + ReasonScaledObjectNotFound))
		g.Expect(status(pol, ConditionReady)).To(Equal("False/" + ReasonScaledObjectNotFound))
	})

	t.Run("an invalid spec stalls at the state last published", func(t *testing.T) {
		g := NewWithT(t)
		pol := policyAt(2)
		invalid := &evalError{reason: ReasonInvalidSpec, err: errors.New("invalid spec: ramp steps must increase")}
		updateStatus(pol, &observed{Evaluated: true, Evaluation: evaluation{Published: published, At: at, Generation: 2, Err: invalid},
			SpecErr: errors.New("ramp steps must increase")})
		g.Expect(status(pol, ConditionStalled)).To(Equal("True/" + ReasonLastStateKept))
		g.Expect(status(pol, ConditionReady)).To(Equal("False/" + ReasonInvalidSpec))
		g.Expect(status(pol, ConditionBreakerOpen)).To(Equal("True/" + ReasonFailureRatioExceeded))
		g.Expect(pol.Status.ObservedGeneration).To(Equal(int64(2)))
		g.Expect(pol.Status.State).To(Equal(spillwayv1alpha1.StateOpen), "the state the fleet keeps")
		g.Expect(pol.Status.CurrentLimit).To(BeZero())
	})

	t.Run("an invalid spec with nothing in Redis", func(t *testing.T) {
		g := NewWithT(t)
		pol := policyAt(2)
		invalid := &evalError{reason: ReasonInvalidSpec, err: errors.New("invalid spec: ramp steps must increase")}
		updateStatus(pol, &observed{Evaluated: true, Evaluation: evaluation{At: at, Generation: 2, Err: invalid},
			SpecErr: errors.New("ramp steps must increase")})
		g.Expect(status(pol, ConditionStalled)).To(Equal("True/" + ReasonInvalidSpec))
		g.Expect(pol.Status.State).To(BeEmpty())
	})

	t.Run("a deletion waiting for Redis", func(t *testing.T) {
		g := NewWithT(t)
		pol := policyAt(2)
		updateStatus(pol, &observed{Deleting: true})
		g.Expect(pol.Status.Conditions).To(BeEmpty(), "a deletion that released its fleet changes no condition")
		updateStatus(pol, &observed{Deleting: true, ReleaseErr: errors.New("connection refused")})
		g.Expect(status(pol, ConditionReady)).To(Equal("False/" + ReasonReleasePending))
		g.Expect(pol.Status.ObservedGeneration).To(Equal(int64(1)))
	})
}
