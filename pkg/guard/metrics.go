package guard

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spillway-dev/spillway/pkg/protocol"
)

// metrics are the guard's Prometheus series, curried by dependency at
// construction so the call path does no label lookups.
type metrics struct {
	calls        map[protocol.Outcome][4]prometheus.Counter
	throttled    map[error]prometheus.Counter
	stale        prometheus.Counter
	superseded   prometheus.Counter
	budgetRefuse prometheus.Counter
	retries      prometheus.Counter
	redisErrors  prometheus.Counter
	leaseLost    prometheus.Counter
	failOpen     prometheus.Counter
	unreadLeases map[unreadResult]prometheus.Counter
	slotWait     prometheus.Observer
	inFlight     prometheus.Gauge
	batchSlots   prometheus.Gauge
	batchLocal   prometheus.Gauge
	// redisEvicting is 1 when the guard started, with AllowEviction, on a
	// Redis that evicts keys.
	redisEvicting prometheus.Gauge
}

// unreadResult is what became of a lease whose reply was never read.
type unreadResult string

const (
	unreadQueued    unreadResult = "queued"    // handed to the forgetter
	unreadForgotten unreadResult = "forgotten" // Redis stopped counting it
	unreadExpired   unreadResult = "expired"   // its TTL passed before Redis answered
	unreadDropped   unreadResult = "dropped"   // the queue was full or the guard closed
)

var attemptLabels = [4]string{"1", "2", "3", "4+"}

func newMetrics(reg prometheus.Registerer, dep string) (*metrics, error) {
	c := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "spillway", Subsystem: "worker", Name: name, Help: help,
		}, append([]string{"dependency"}, labels...))
	}
	calls := c("calls_total", "Calls made to the dependency, by outcome (success, failure, timeout, cancelled) and attempt number.", "outcome", "attempt")
	throttled := c("throttled_total", "Calls not made because the fleet refused them, by reason (slots, rate, open, redis_unavailable, no_policy, version).", "reason")
	stale := c("stale_dropped_total", "Jobs dropped before any call because they were past their deadline.")
	superseded := c("superseded_total", "Jobs dropped before any call because a newer version exists.")
	budget := c("budget_refusals_total", "Failed calls parked because the fleet's retry budget was spent.")
	retries := c("retries_scheduled_total", "Failed calls the retry budget allowed to retry.")
	redisErrors := c("redis_errors_total", "Redis round trips that failed or timed out.")
	leaseLost := c("lease_lost_total", "Calls whose lease expired before it was renewed.")
	failOpen := c("fail_open_calls_total", "Calls admitted by the local cap while Redis was unavailable.")
	unread := c("unread_leases_total", "Leases whose acquire or release reply was never read, by what became of them (queued for forgetting, forgotten, expired first, dropped).", "result")
	wait := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: "spillway", Subsystem: "worker", Name: "slot_wait_seconds",
		Help:    "Time spent waiting for a fleet-wide slot before a call was admitted.",
		Buckets: prometheus.ExponentialBuckets(0.001, 4, 10),
	}, []string{"dependency"})

	inFlight := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: "spillway", Subsystem: "worker", Name: "in_flight",
		Help: "Calls admitted and not yet finished, fail-open admissions included.",
	}, []string{"dependency"})

	batchSlots := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: "spillway", Subsystem: "worker", Name: "batch_slots",
		Help: "Batch mode: fleet slots the process holds in its local pool, idle or in use.",
	}, []string{"dependency"})
	batchLocal := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: "spillway", Subsystem: "worker", Name: "batch_local",
		Help: "Batch mode: 1 while calls take slots from the local pool, 0 while they go per call (HalfOpen, Open, the dead-man rule, Redis unreachable, a rate limit too low to batch).",
	}, []string{"dependency"})

	evicting := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: "spillway", Subsystem: "worker", Name: "redis_evicting",
		Help: "1 when the guard started (Options.AllowEviction) on a Redis whose maxmemory-policy evicts keys: leases and the published state may disappear, and the fleet's limits no longer hold.",
	}, []string{"dependency"})

	vecs := []**prometheus.CounterVec{&calls, &throttled, &stale, &superseded, &budget, &retries, &redisErrors, &leaseLost, &failOpen, &unread}
	for _, v := range vecs {
		var err error
		if *v, err = register(reg, *v); err != nil {
			return nil, err
		}
	}
	wait, err := register(reg, wait)
	if err != nil {
		return nil, err
	}
	for _, v := range []**prometheus.GaugeVec{&inFlight, &batchSlots, &batchLocal, &evicting} {
		if *v, err = register(reg, *v); err != nil {
			return nil, err
		}
	}
	m := &metrics{
		calls:        map[protocol.Outcome][4]prometheus.Counter{},
		throttled:    map[error]prometheus.Counter{},
		stale:        stale.WithLabelValues(dep),
		superseded:   superseded.WithLabelValues(dep),
		budgetRefuse: budget.WithLabelValues(dep),
		retries:      retries.WithLabelValues(dep),
		redisErrors:  redisErrors.WithLabelValues(dep),
		leaseLost:    leaseLost.WithLabelValues(dep),
		failOpen:     failOpen.WithLabelValues(dep),
		unreadLeases: map[unreadResult]prometheus.Counter{},
		slotWait:     wait.WithLabelValues(dep),
		inFlight:     inFlight.WithLabelValues(dep),
		batchSlots:   batchSlots.WithLabelValues(dep),
		batchLocal:   batchLocal.WithLabelValues(dep),

		redisEvicting: evicting.WithLabelValues(dep),
	}
	for _, r := range []unreadResult{unreadQueued, unreadForgotten, unreadExpired, unreadDropped} {
		m.unreadLeases[r] = unread.WithLabelValues(dep, string(r))
	}
	for o, name := range map[protocol.Outcome]string{
		protocol.Success: "success", protocol.Failure: "failure", protocol.Timeout: "timeout", protocol.Cancelled: "cancelled",
	} {
		var byAttempt [4]prometheus.Counter
		for i, a := range attemptLabels {
			byAttempt[i] = calls.WithLabelValues(dep, name, a)
		}
		m.calls[o] = byAttempt
	}
	for reason, name := range map[error]string{
		ErrThrottled: "slots", ErrRateLimited: "rate", ErrOpen: "open",
		ErrRedisUnavailable: "redis_unavailable", ErrNoPolicy: "no_policy", ErrVersion: "version",
	} {
		m.throttled[reason] = throttled.WithLabelValues(dep, name)
	}
	return m, nil
}

// call counts a call by outcome; an outcome the protocol does not know (a
// custom Classify's mistake) is not counted: Done reports it as an error.
func (m *metrics) call(o protocol.Outcome, attempt int) {
	byAttempt, ok := m.calls[o]
	if !ok {
		return
	}
	byAttempt[min(max(attempt, 1), 4)-1].Inc()
}

func (m *metrics) unread(r unreadResult) { m.unreadLeases[r].Inc() }

// register registers col, or returns the collector already registered under
// its name, so that several guards (one per dependency) share one registry.
func register[C prometheus.Collector](reg prometheus.Registerer, col C) (C, error) {
	if reg == nil {
		return col, nil
	}
	err := reg.Register(col)
	if err == nil {
		return col, nil
	}
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(C); ok {
			return existing, nil
		}
	}
	return col, fmt.Errorf("failed to register metrics: %w", err)
}
