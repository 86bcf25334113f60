package controllers

import (
	"errors"
	"math"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/spillway-dev/spillway/internal/control"
)

func TestSignalFrom(t *testing.T) {
	now := time.Date(2026, 12, 1, 4, 0, 0, 0, time.UTC)
	window := 30 * time.Second
	cases := []struct {
		name   string
		res    *signalResult
		want   control.Signal
		reason string
		status metav1.ConditionStatus
	}{
		{name: "no answer yet", res: nil, reason: ReasonSignalPending, status: metav1.ConditionUnknown},
		{name: "ratio only", res: &signalResult{At: now.Add(-2 * time.Second), Ratio: 0.3, Rate: math.NaN()},
			want: control.Signal{Valid: true, Ratio: 0.3, Calls: -1, Age: 2 * time.Second}, reason: ReasonSignalHealthy, status: metav1.ConditionTrue},
		{name: "ratio and rate", res: &signalResult{At: now, Ratio: 0.3, Rate: 4},
			want: control.Signal{Valid: true, Ratio: 0.3, Calls: 120}, reason: ReasonSignalHealthy, status: metav1.ConditionTrue},
		{name: "no data", res: &signalResult{At: now, Err: ErrNoData}, reason: ReasonNoData, status: metav1.ConditionTrue},
		{name: "unreachable", res: &signalResult{At: now, Err: &SignalError{Reason: ReasonPrometheusUnreachable, Err: errors.New("connection refused")}},
			reason: ReasonPrometheusUnreachable, status: metav1.ConditionFalse},
		{name: "bad query", res: &signalResult{At: now, Err: &SignalError{Reason: ReasonQueryFailed, Err: errors.New("parse error")}},
			reason: ReasonQueryFailed, status: metav1.ConditionFalse},
		{name: "credentials", res: &signalResult{At: now, Err: &SignalError{Reason: ReasonCredentialsUnavailable, Err: errors.New("not found")}},
			reason: ReasonCredentialsUnavailable, status: metav1.ConditionFalse},
		{name: "any other error is unreachable", res: &signalResult{At: now, Err: errors.New("boom")},
			reason: ReasonPrometheusUnreachable, status: metav1.ConditionFalse},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			sig, st := signalFrom(tc.res, window, now)
			g.Expect(sig).To(Equal(tc.want))
			g.Expect(st.Reason).To(Equal(tc.reason))
			g.Expect(signalsHealthyCondition(st).Status).To(Equal(tc.status))
			if tc.status == metav1.ConditionFalse {
				g.Expect(st.Message).To(ContainSubstring("never opens it"))
			}
		})
	}
}

func TestReadyWithSignals(t *testing.T) {
	ready := metav1.Condition{Type: ConditionReady, Status: metav1.ConditionTrue, Reason: ReasonEvaluated, Message: "Published state Closed with limit 40 (epoch 1)"}
	redisDown := metav1.Condition{Type: ConditionReady, Status: metav1.ConditionFalse, Reason: ReasonRedisUnavailable, Message: "Cannot reach Redis"}
	failing := signalStatus{Configured: true, Reason: ReasonPrometheusUnreachable, Message: "connection refused"}
	g := NewWithT(t)

	g.Expect(readyWithSignals(ready, signalStatus{})).To(Equal(ready), "no signal: Ready unchanged")
	got := readyWithSignals(ready, signalStatus{Configured: true, Reason: ReasonSignalHealthy})
	g.Expect(got.Status).To(Equal(metav1.ConditionTrue))
	g.Expect(got.Message).To(HaveSuffix("; signals: the workers' outcomes and Prometheus are healthy"))
	got = readyWithSignals(ready, failing)
	g.Expect(got.Status).To(Equal(metav1.ConditionFalse))
	g.Expect(got.Reason).To(Equal(ReasonPrometheusUnreachable))
	g.Expect(got.Message).To(ContainSubstring("the workers' outcomes are healthy, Prometheus is failing"))
	g.Expect(readyWithSignals(redisDown, failing)).To(Equal(redisDown), "Redis first")
	got = readyWithSignals(ready, signalStatus{Configured: true, Reason: ReasonNoData})
	g.Expect(got.Status).To(Equal(metav1.ConditionTrue))
	g.Expect(got.Message).To(ContainSubstring("Prometheus has no data"))
	got = readyWithSignals(ready, signalStatus{Configured: true, Reason: ReasonSignalPending})
	g.Expect(got.Status).To(Equal(metav1.ConditionTrue))
	g.Expect(got.Message).To(ContainSubstring("Prometheus has not answered yet"))
}

func TestSignalEvent(t *testing.T) {
	healthy := signalStatus{Configured: true, Reason: ReasonSignalHealthy, Message: "ok"}
	down := signalStatus{Configured: true, Reason: ReasonPrometheusUnreachable, Message: "down"}
	bad := signalStatus{Configured: true, Reason: ReasonQueryFailed, Message: "bad"}
	cases := []struct {
		name   string
		prev   string
		st     signalStatus
		typ    string
		reason string
	}{
		{name: "first answer healthy", prev: ReasonSignalPending, st: healthy},
		{name: "first answer failing", prev: ReasonSignalPending, st: down, typ: corev1.EventTypeWarning, reason: EventSignalUnavailable},
		{name: "starts failing", prev: ReasonSignalHealthy, st: down, typ: corev1.EventTypeWarning, reason: EventSignalUnavailable},
		{name: "still failing", prev: ReasonPrometheusUnreachable, st: down},
		{name: "fails differently", prev: ReasonPrometheusUnreachable, st: bad, typ: corev1.EventTypeWarning, reason: EventSignalUnavailable},
		{name: "recovers", prev: ReasonQueryFailed, st: healthy, typ: corev1.EventTypeNormal, reason: EventSignalRecovered},
		{name: "recovers to no data", prev: ReasonQueryFailed, st: signalStatus{Configured: true, Reason: ReasonNoData}, typ: corev1.EventTypeNormal, reason: EventSignalRecovered},
		{name: "healthy to no data", prev: ReasonSignalHealthy, st: signalStatus{Configured: true, Reason: ReasonNoData}},
		{name: "no signal", prev: "", st: signalStatus{}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			typ, reason, _, ok := signalEvent(tc.prev, tc.st)
			if ok != (tc.reason != "") || typ != tc.typ || reason != tc.reason {
				t.Errorf("signalEvent(%q, %s) = %q %q %v, want %q %q", tc.prev, tc.st.Reason, typ, reason, ok, tc.typ, tc.reason)
			}
		})
	}
}
