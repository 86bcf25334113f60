package controllers

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/control"
	"github.com/spillway-dev/spillway/internal/policy"
)

// The controller reads a policy's Prometheus credentials Secret with get,
// uncached: it neither lists nor watches Secrets, and reads only the one a
// policy names, in the policy's namespace.
// +kubebuilder:rbac:groups="",resources=secrets,verbs=get

// ConditionSignalsHealthy is the condition of a policy that names a
// Prometheus signal (spec.signals.prometheus): True while its queries
// answer, False while they fail. A failing signal never opens the breaker:
// the breaker goes on with the workers' outcomes alone. Absent when the
// policy names no signal.
const ConditionSignalsHealthy = "SignalsHealthy"

// Reasons of the SignalsHealthy condition; a False one is also Ready's
// reason.
const (
	// ReasonSignalHealthy (True): the last queries answered with a value.
	ReasonSignalHealthy = "Healthy"
	// ReasonNoData (True): the error ratio query answered with no data: no
	// traffic (0/0), or no such series. It opens nothing until it has data.
	ReasonNoData = "NoData"
	// ReasonSignalPending (Unknown): the first queries have not answered yet.
	ReasonSignalPending = "Pending"
	// ReasonPrometheusUnreachable (False): Prometheus could not be reached,
	// did not answer within the signal's timeout, or failed (5xx).
	ReasonPrometheusUnreachable = "PrometheusUnreachable"
	// ReasonQueryFailed (False): Prometheus refused a query (bad PromQL, an
	// authentication failure, more than one series, a value not a number), or
	// the address answered with something else than a query result.
	ReasonQueryFailed = "QueryFailed"
	// ReasonCredentialsUnavailable (False): the credentials Secret cannot be
	// read, or holds neither "token" nor "username" and "password".
	ReasonCredentialsUnavailable = "CredentialsUnavailable"
)

// Event reasons of the signals.
const (
	// EventSignalUnavailable (Warning): a signal's queries started failing.
	EventSignalUnavailable = "SignalUnavailable"
	// EventSignalRecovered (Normal): a signal's queries answer again.
	EventSignalRecovered = "SignalRecovered"
)

// signalQueryFailures counts the rounds of Prometheus queries that failed,
// by SignalsHealthy reason (no data is not a failure).
var signalQueryFailures = prometheus.NewCounterVec(prometheus.CounterOpts{
	Name: "spillway_signal_query_failures_total",
	Help: "Rounds of a DependencyPolicy's Prometheus signal queries that failed, by reason (PrometheusUnreachable, QueryFailed, CredentialsUnavailable).",
}, []string{"reason"})

func init() {
	metrics.Registry.MustRegister(signalQueryFailures)
}

// Signals runs each policy's Prometheus queries in the background, one at a
// time per policy, at most once per spec.signals.prometheus.interval, each
// bounded by its timeout, and hands the evaluator the last answer. Observe
// never waits for a query: a slow or hung Prometheus delays the signal,
// never a limit. The zero value is not usable; the evaluator builds one when
// none is given.
type Signals struct {
	// Querier runs the queries. Default: PrometheusHTTP.
	Querier PrometheusQuerier
	// Secrets reads credentials Secrets, uncached (get only). Required when a
	// policy names one.
	Secrets client.Reader
	// Clock times the queries. Default: the wall clock.
	Clock clock.PassiveClock

	mu       sync.Mutex
	policies map[types.NamespacedName]*signalState
}

// signalState is one policy's signal: its spec, the query in flight and the
// last answer.
type signalState struct {
	spec    spillwayv1alpha1.PrometheusSignal
	running bool
	started time.Time
	result  *signalResult
	// reported is the last reason Observe returned other than Pending, to
	// tell a change (an Event) across a change of spec.
	reported string
}

// signalResult is the answer to one round of queries.
type signalResult struct {
	// At is when the queries began, by Clock: the measurement is no older.
	At    time.Time
	Ratio float64
	// Rate is the request rate; NaN without a rate query.
	Rate float64
	Err  error
}

// signalStatus is what status shows of a policy's signal.
type signalStatus struct {
	// Configured is true when the policy names a signal.
	Configured bool
	Reason     string
	Message    string
}

// NewSignals returns a store that queries with querier and reads Secrets
// with secrets.
func NewSignals(querier PrometheusQuerier, secrets client.Reader) *Signals {
	return &Signals{Querier: querier, Secrets: secrets}
}

// Observe starts the policy's queries when they are due and none is in
// flight, and returns, without waiting, the signal Plan takes (window is the
// breaker window a request rate is counted over), its status, and the last
// reason other than Pending that a call returned ("" before any).
func (s *Signals) Observe(pol *spillwayv1alpha1.DependencyPolicy, window time.Duration) (control.Signal, signalStatus, string) {
	key := types.NamespacedName{Namespace: pol.Namespace, Name: pol.Name}
	s.mu.Lock()
	defer s.mu.Unlock()
	if pol.Spec.Signals == nil || pol.Spec.Signals.Prometheus == nil {
		delete(s.policies, key)
		return control.Signal{}, signalStatus{}, ""
	}
	if s.policies == nil {
		s.policies = map[types.NamespacedName]*signalState{}
	}
	clk := s.clock()
	spec := *pol.Spec.Signals.Prometheus
	st := s.policies[key]
	if st == nil || !samePrometheusSignal(st.spec, spec) {
		// A new spec queries afresh, but a recovery from the old one's
		// failure is still reported.
		next := &signalState{spec: spec}
		if st != nil {
			next.reported = st.reported
		}
		st = next
		s.policies[key] = st
	}
	now := clk.Now()
	if !st.running && (st.started.IsZero() || now.Sub(st.started) >= signalInterval(spec)) {
		st.running, st.started = true, now
		go s.run(key, st, pol.Namespace, spec, now)
	}
	sig, status := signalFrom(st.result, window, now)
	prev := st.reported
	if status.Reason != ReasonSignalPending {
		st.reported = status.Reason
	}
	return sig, status, prev
}

// Forget drops a deleted policy's signal; a query in flight is discarded.
func (s *Signals) Forget(key types.NamespacedName) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.policies, key)
}

func (s *Signals) clock() clock.PassiveClock {
	if s.Clock == nil {
		return clock.RealClock{}
	}
	return s.Clock
}

// run queries once, bounded by the signal's timeout, and stores the answer
// if the policy's signal is still st.
func (s *Signals) run(key types.NamespacedName, st *signalState, namespace string, spec spillwayv1alpha1.PrometheusSignal, at time.Time) {
	ctx, cancel := context.WithTimeout(context.Background(), signalTimeout(spec))
	defer cancel()
	res := &signalResult{At: at, Rate: math.NaN()}
	res.Ratio, res.Rate, res.Err = s.query(ctx, namespace, spec)
	if res.Err != nil && !errors.Is(res.Err, ErrNoData) {
		_, st := signalFrom(res, 0, at)
		signalQueryFailures.WithLabelValues(st.Reason).Inc()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	st.running = false
	if s.policies[key] == st {
		st.result = res
	}
}

// query reads the credentials and runs the error ratio query, then the rate
// query if any.
func (s *Signals) query(ctx context.Context, namespace string, spec spillwayv1alpha1.PrometheusSignal) (ratio, rate float64, err error) {
	rate = math.NaN()
	target := PrometheusTarget{Address: spec.Address}
	if ref := spec.CredentialsSecretRef; ref != nil {
		if target, err = s.credentials(ctx, namespace, ref.Name, target); err != nil {
			return 0, rate, err
		}
	}
	q := s.Querier
	if q == nil {
		q = PrometheusHTTP{}
	}
	if ratio, err = q.QueryValue(ctx, target, spec.ErrorRatioQuery); err != nil {
		return 0, rate, err
	}
	if spec.RateQuery == "" {
		return ratio, rate, nil
	}
	rate, err = q.QueryValue(ctx, target, spec.RateQuery)
	if errors.Is(err, ErrNoData) {
		// A ratio with data but no rate: count it as no traffic.
		return ratio, 0, nil
	}
	return ratio, rate, err
}

// credentials fills target from the Secret name in namespace: "token", or
// "username" and "password".
func (s *Signals) credentials(ctx context.Context, namespace, name string, target PrometheusTarget) (PrometheusTarget, error) {
	fail := func(err error) (PrometheusTarget, error) {
		return target, &SignalError{Reason: ReasonCredentialsUnavailable, Err: err}
	}
	if s.Secrets == nil {
		return fail(errors.New("no Secret reader configured"))
	}
	var secret corev1.Secret
	if err := s.Secrets.Get(ctx, types.NamespacedName{Namespace: namespace, Name: name}, &secret); err != nil {
		return fail(fmt.Errorf("failed to read credentials Secret %s: %w", name, err))
	}
	switch {
	case len(secret.Data["token"]) > 0:
		target.BearerToken = string(secret.Data["token"])
	case len(secret.Data["username"]) > 0:
		target.Username, target.Password = string(secret.Data["username"]), string(secret.Data["password"])
	default:
		return fail(fmt.Errorf("credentials Secret %s holds neither \"token\" nor \"username\" and \"password\"", name))
	}
	return target, nil
}

// signalFrom is the signal Plan takes and the status shown for the last
// answer res (nil before the first), at now. Only an answer with a value is
// a valid signal.
func signalFrom(res *signalResult, window time.Duration, now time.Time) (control.Signal, signalStatus) {
	st := signalStatus{Configured: true}
	switch {
	case res == nil:
		st.Reason, st.Message = ReasonSignalPending, "The Prometheus queries have not answered yet"
		return control.Signal{}, st
	case errors.Is(res.Err, ErrNoData):
		st.Reason = ReasonNoData
		st.Message = "The error ratio query returned no data (no traffic, or no such series); it opens nothing until it has data"
		return control.Signal{}, st
	case res.Err != nil:
		st.Reason = ReasonPrometheusUnreachable
		var se *SignalError
		if errors.As(res.Err, &se) {
			st.Reason = se.Reason
		}
		st.Message = "The Prometheus signal is failing, so the breaker runs on the workers' outcomes alone (a failing query never opens it): " + res.Err.Error()
		return control.Signal{}, st
	}
	st.Reason, st.Message = ReasonSignalHealthy, "The Prometheus queries answer"
	sig := control.Signal{Valid: true, Ratio: res.Ratio, Calls: -1, Age: max(now.Sub(res.At), 0)}
	if !math.IsNaN(res.Rate) {
		sig.Calls = control.CallsOver(res.Rate, window)
	}
	return sig, st
}

// signalsHealthyCondition is the SignalsHealthy condition of st.
func signalsHealthyCondition(st signalStatus) metav1.Condition {
	c := metav1.Condition{Type: ConditionSignalsHealthy, Reason: st.Reason, Message: st.Message}
	switch st.Reason {
	case ReasonSignalHealthy, ReasonNoData:
		c.Status = metav1.ConditionTrue
	case ReasonSignalPending:
		c.Status = metav1.ConditionUnknown
	default:
		c.Status = metav1.ConditionFalse
	}
	return c
}

// readyWithSignals adds the signals to the Ready condition: its message says
// which signals are healthy, and a failing Prometheus signal makes a True
// Ready False with the signal's reason (it never opens the breaker). A policy
// without signals keeps ready as it is.
func readyWithSignals(ready metav1.Condition, st signalStatus) metav1.Condition {
	if !st.Configured {
		return ready
	}
	signals := signalsHealthyCondition(st)
	switch {
	case ready.Status != metav1.ConditionTrue:
		return ready
	case signals.Status == metav1.ConditionFalse:
		ready.Status, ready.Reason = metav1.ConditionFalse, signals.Reason
		ready.Message += "; signals: the workers' outcomes are healthy, Prometheus is failing (" + signals.Reason + ")"
	case st.Reason == ReasonNoData:
		ready.Message += "; signals: the workers' outcomes and Prometheus are healthy (Prometheus has no data)"
	case st.Reason == ReasonSignalPending:
		ready.Message += "; signals: the workers' outcomes are healthy, Prometheus has not answered yet"
	default:
		ready.Message += "; signals: the workers' outcomes and Prometheus are healthy"
	}
	return ready
}

// signalEvent is the Event for a signal whose reason changed to st's from a
// different one: Warning when it starts failing, Normal when it recovers;
// false when there is nothing to say (first answer, pending, or between two
// healthy reasons).
func signalEvent(prevReason string, st signalStatus) (eventType, reason, message string, ok bool) {
	if !st.Configured {
		return "", "", "", false
	}
	failing := signalsHealthyCondition(st).Status == metav1.ConditionFalse
	wasFailing := prevReason != "" && signalsHealthyCondition(signalStatus{Reason: prevReason}).Status == metav1.ConditionFalse
	switch {
	case failing && prevReason != st.Reason:
		return corev1.EventTypeWarning, EventSignalUnavailable, st.Message, true
	case wasFailing && !failing && st.Reason != ReasonSignalPending:
		return corev1.EventTypeNormal, EventSignalRecovered, st.Message, true
	}
	return "", "", "", false
}

// signalInterval and signalTimeout are the spec's, or their API defaults
// when zero (a spec built in Go).
func signalInterval(spec spillwayv1alpha1.PrometheusSignal) time.Duration {
	if spec.Interval.Duration <= 0 {
		return 15 * time.Second
	}
	return spec.Interval.Duration
}

func signalTimeout(spec spillwayv1alpha1.PrometheusSignal) time.Duration {
	if spec.Timeout.Duration <= 0 {
		return min(5*time.Second, signalInterval(spec))
	}
	return spec.Timeout.Duration
}

func samePrometheusSignal(a, b spillwayv1alpha1.PrometheusSignal) bool {
	return a.Address == b.Address && a.ErrorRatioQuery == b.ErrorRatioQuery && a.RateQuery == b.RateQuery &&
		a.Interval == b.Interval && a.Timeout == b.Timeout &&
		(a.CredentialsSecretRef == nil) == (b.CredentialsSecretRef == nil) &&
		(a.CredentialsSecretRef == nil || a.CredentialsSecretRef.Name == b.CredentialsSecretRef.Name)
}

// observeSignals is the evaluator's look at pol's external signal: the
// signal Plan takes and its status, with an Event when the signal starts
// failing or recovers. It never waits for a query.
func (r *Evaluator) observeSignals(pol *spillwayv1alpha1.DependencyPolicy, params policy.Params) (control.Signal, signalStatus) {
	sig, st, prev := r.Signals.Observe(pol, params.Breaker.Window)
	if typ, reason, msg, ok := signalEvent(prev, st); ok {
		r.Recorder.Eventf(pol, nil, typ, reason, "Evaluate", "%s", msg)
	}
	return sig, st
}

// setSignalsCondition sets the SignalsHealthy condition of a policy that
// names a signal, and removes it from one that does not.
func setSignalsCondition(pol *spillwayv1alpha1.DependencyPolicy, st signalStatus) {
	if !st.Configured {
		meta.RemoveStatusCondition(&pol.Status.Conditions, ConditionSignalsHealthy)
		return
	}
	setCondition(pol, signalsHealthyCondition(st))
}
