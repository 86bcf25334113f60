package controllers

import (
	"time"

	"github.com/spillway-dev/spillway/pkg/retry"
)

// Options tune the controllers. Zero values take the defaults. The Evaluator
// and the PolicyReconciler take the same Options.
type Options struct {
	// EvaluationInterval is how often each policy is evaluated. Default 1s.
	EvaluationInterval time.Duration
	// StatusInterval is how often the policy reconciler runs without being
	// triggered, and how far behind the window counts in status may fall
	// (see statusDue). Each policy uses a fixed point of its second half, so
	// policies created together do not write together. Default 10s.
	StatusInterval time.Duration
	// RedisTimeout bounds each Redis operation. Default 500ms.
	RedisTimeout time.Duration
	// MaxConcurrentReconciles is how many policies the evaluator, and
	// separately the policy reconciler, work on at once. Default 8; at
	// least 4.
	MaxConcurrentReconciles int
	// MaxRetryDelay caps the backoff after a failed evaluation. Default 10s.
	MaxRetryDelay time.Duration
	// StaleAfter is the dead-man bound published with every state: workers
	// treat an Open state published longer ago as HalfOpen. Default
	// StaleAfter(EvaluationInterval); negative turns the rule off.
	StaleAfter time.Duration
	// KEDADiscoveryInterval is how often a manager started without KEDA's
	// ScaledObject CRD asks whether it is served now, to start watching
	// ScaledObjects without a restart. Default DefaultKEDADiscoveryInterval.
	KEDADiscoveryInterval time.Duration
}

func (o Options) withDefaults() Options {
	if o.EvaluationInterval <= 0 {
		o.EvaluationInterval = time.Second
	}
	if o.StatusInterval <= 0 {
		o.StatusInterval = 10 * time.Second
	}
	if o.RedisTimeout <= 0 {
		o.RedisTimeout = 500 * time.Millisecond
	}
	if o.MaxConcurrentReconciles <= 0 {
		o.MaxConcurrentReconciles = 8
	}
	o.MaxConcurrentReconciles = max(o.MaxConcurrentReconciles, 4)
	if o.MaxRetryDelay <= 0 {
		o.MaxRetryDelay = 10 * time.Second
	}
	o.MaxRetryDelay = max(o.MaxRetryDelay, o.EvaluationInterval)
	if o.KEDADiscoveryInterval <= 0 {
		o.KEDADiscoveryInterval = DefaultKEDADiscoveryInterval
	}
	return o
}

// DeadManIntervals is N of the dead-man rule: a state published more than N
// evaluation intervals ago (and at least MinStaleAfter) is stale, and workers
// treat a stale Open as HalfOpen (docs/protocol.md §3, the dead-man rule).
const DeadManIntervals = 30

// MinStaleAfter is the dead-man rule's floor. A manager that crashes hands
// over to another replica within the leader-election lease (15 s by default)
// plus its start: the rule must not fire during an ordinary handover.
const MinStaleAfter = 30 * time.Second

// StaleAfter is the dead-man bound for an evaluation interval:
// DeadManIntervals intervals, at least MinStaleAfter.
func StaleAfter(interval time.Duration) time.Duration {
	return max(DeadManIntervals*interval, MinStaleAfter)
}

// staleAfter is the dead-man bound the evaluator publishes: Options.StaleAfter,
// or StaleAfter(EvaluationInterval) when unset, or 0 (the rule off) when
// negative.
func (o Options) staleAfter() time.Duration {
	switch {
	case o.StaleAfter < 0:
		return 0
	case o.StaleAfter > 0:
		return o.StaleAfter
	}
	return StaleAfter(o.EvaluationInterval)
}

// jitter spreads a retry delay uniformly over [0.8d, 1.2d] (the full jitter
// of retry.FullJitter over 40% of d, after 80% of it), so policies that
// failed together do not retry together.
func jitter(d time.Duration) time.Duration {
	return d*4/5 + retry.FullJitter(d*2/5, nil)
}
