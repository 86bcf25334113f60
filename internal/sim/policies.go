package sim

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/pkg/retry"
)

// Policy names a caller policy. Each adds one mechanism to the one before
// it, so neighbouring rows of a report differ by exactly one mechanism.
type Policy string

const (
	// ImmediateRetry retries a failed job at once.
	ImmediateRetry Policy = "immediate-retry"
	// PlainBackoff retries after the exponential ceiling, with no jitter
	// (retry.Backoff with JitterNone).
	PlainBackoff Policy = "plain-backoff"
	// SmallJitter is PlainBackoff times uniform(0.9, 1.1): the seed's
	// "equal jitter of ±10%" baseline, which Spillway does not ship.
	SmallJitter Policy = "small-jitter"
	// FullJitter draws the delay uniformly from [0, ceiling]
	// (retry.Backoff with JitterFull).
	FullJitter Policy = "full-jitter"
	// Cap adds a fleet-wide concurrency cap at capacity.concurrency.
	Cap Policy = "cap"
	// CapRamp adds the breaker and the slow-start ramp, run by a controller
	// every second of virtual time.
	CapRamp Policy = "cap-ramp"
	// CapRampBudget adds the retry budget: over budget a failing job is
	// parked with retry.Park.
	CapRampBudget Policy = "cap-ramp-budget"
	// Spillway is everything the DependencyPolicy says, with its own
	// backoff jitter, plus deadlines, deduplication of superseded jobs and
	// the controller's bounds on the consumers' replicas.
	Spillway Policy = "spillway"
)

// Policies returns every policy, from the most naive to Spillway.
func Policies() []Policy {
	return []Policy{ImmediateRetry, PlainBackoff, SmallJitter, FullJitter, Cap, CapRamp, CapRampBudget, Spillway}
}

// ParsePolicies parses a comma-separated list of policy names; an empty
// string means all of them.
func ParsePolicies(list string) ([]Policy, error) {
	if strings.TrimSpace(list) == "" {
		return Policies(), nil
	}
	var out []Policy
	seen := map[Policy]bool{}
	for _, name := range strings.Split(list, ",") {
		p := Policy(strings.TrimSpace(name))
		if !p.valid() {
			return nil, fmt.Errorf("unknown policy %q (known: %s)", p, joinPolicies(Policies()))
		}
		if !seen[p] {
			seen[p] = true
			out = append(out, p)
		}
	}
	return out, nil
}

func joinPolicies(ps []Policy) string {
	names := make([]string, len(ps))
	for i, p := range ps {
		names[i] = string(p)
	}
	return strings.Join(names, ", ")
}

func (p Policy) valid() bool {
	for _, known := range Policies() {
		if p == known {
			return true
		}
	}
	return false
}

// mechanisms are the parts a policy switches on.
type mechanisms struct {
	// delay computes the retry delay after attempt failed.
	delay func(attempt int, rnd *rand.Rand) time.Duration
	// capped limits in-flight calls fleet-wide.
	capped bool
	// controlled runs the breaker and ramp.
	controlled bool
	// budgeted parks retries over the retry budget.
	budgeted bool
	// dropUseless drops stale and superseded jobs before calling.
	dropUseless bool
	// boundReplicas applies the controller's bounds to the autoscaler.
	boundReplicas bool
}

// mechanismsFor returns what p switches on, with the backoff base and max
// taken from the DependencyPolicy so that only the named mechanism differs.
func mechanismsFor(p Policy, params policy.Params) mechanisms {
	plain := retry.Backoff{Base: params.Backoff.Base, Max: params.Backoff.Max, Jitter: retry.JitterNone}
	full := plain
	full.Jitter = retry.JitterFull
	m := mechanisms{delay: func(attempt int, rnd *rand.Rand) time.Duration { return full.Delay(attempt, rnd) }}
	switch p {
	case ImmediateRetry:
		m.delay = func(int, *rand.Rand) time.Duration { return 0 }
	case PlainBackoff:
		m.delay = func(attempt int, _ *rand.Rand) time.Duration { return plain.Delay(attempt, nil) }
	case SmallJitter:
		m.delay = func(attempt int, rnd *rand.Rand) time.Duration {
			c := plain.Delay(attempt, nil)
			return c*9/10 + retry.FullJitter(c/5, rnd) // uniform in [0.9c, 1.1c]
		}
	case FullJitter:
	case Cap:
		m.capped = true
	case CapRamp:
		m.capped, m.controlled = true, true
	case CapRampBudget:
		m.capped, m.controlled, m.budgeted = true, true, true
	case Spillway:
		own := params.Backoff
		m.delay = func(attempt int, rnd *rand.Rand) time.Duration { return own.Delay(attempt, rnd) }
		m.capped, m.controlled, m.budgeted, m.dropUseless, m.boundReplicas = true, true, true, true, true
	}
	return m
}
