package shed

import (
	"fmt"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spillway-dev/spillway/pkg/clock"
	"github.com/spillway-dev/spillway/pkg/retry"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// Defaults applied by New to zero-valued Options fields.
const (
	// DefaultRetryAfterMin is RetryAfterMin when unset.
	DefaultRetryAfterMin = time.Second
	// DefaultRetryAfterMax is RetryAfterMax when unset, unless twice
	// RetryAfterMin is larger: see Options.RetryAfterMax.
	DefaultRetryAfterMax = 10 * time.Second
)

// Ramp is a slow start for a service that comes back with cold caches: the
// concurrency limit climbs through Steps, one step per StepDuration, up to
// MaxInFlight. For example Steps [5 10 20 40] with StepDuration one minute
// and MaxInFlight 40 admit 5 requests at once, then 10 after a minute, 20
// after two and all 40 after three.
type Ramp struct {
	// Steps are the limits to climb through: at least one, each >= 1 and
	// <= MaxInFlight, strictly increasing. The last is normally
	// MaxInFlight; the limit stays at the last step once it is reached.
	Steps []int64
	// StepDuration is how long each step lasts before the next; > 0.
	StepDuration time.Duration
}

// validate checks r against maxInFlight, naming the field as Options spells
// it (Ramp.Steps[i], Ramp.StepDuration).
func (r *Ramp) validate(maxInFlight int64) error {
	if len(r.Steps) == 0 {
		return fmt.Errorf("Ramp.Steps must not be empty")
	}
	for i, v := range r.Steps {
		switch {
		case v < 1:
			return fmt.Errorf("Ramp.Steps[%d] must be >= 1, got %d", i, v)
		case v > maxInFlight:
			return fmt.Errorf("Ramp.Steps[%d] must be <= MaxInFlight (%d), got %d", i, maxInFlight, v)
		case i > 0 && v <= r.Steps[i-1]:
			return fmt.Errorf("Ramp.Steps must be strictly increasing, got Ramp.Steps[%d]=%d after Ramp.Steps[%d]=%d", i, v, i-1, r.Steps[i-1])
		}
	}
	if r.StepDuration <= 0 {
		return fmt.Errorf("Ramp.StepDuration must be > 0, got %v", r.StepDuration)
	}
	return nil
}

// Options configures a Shedder. Only MaxInFlight is required.
type Options struct {
	// MaxInFlight is the most requests admitted at once; >= 1.
	MaxInFlight int64
	// QueueSize is how many requests may wait for a slot when all
	// MaxInFlight are taken; >= 0. 0, the default, rejects at once.
	QueueSize int
	// QueueTimeout is the longest a request waits in the queue; > 0 when
	// QueueSize > 0. A request's own deadline, if sooner, ends the wait too.
	QueueTimeout time.Duration

	// RetryAfterMin and RetryAfterMax bound the Retry-After sent with 503
	// and 429, drawn uniformly in whole seconds from the closed range. Both
	// must be whole seconds, RetryAfterMin >= 1s and RetryAfterMin <=
	// RetryAfterMax.
	//
	// RetryAfterMin defaults to DefaultRetryAfterMin (1s).
	RetryAfterMin time.Duration
	// RetryAfterMax defaults to the larger of DefaultRetryAfterMax (10s) and
	// 2 × RetryAfterMin, so setting only RetryAfterMin never leaves an empty
	// or constant range: RetryAfterMin 15s alone gives 15–30 s, 3s alone
	// gives 3–10 s.
	RetryAfterMax time.Duration

	// CallerHeader names the HTTP header carrying the caller's API key; its
	// lower-case form is the gRPC metadata key. Default
	// wire.DefaultCallerHeader (X-Api-Key).
	CallerHeader string
	// DefaultQuota is the most requests one API key may have admitted or
	// queued at once; >= 0. 0, the default, gives callers no quota of their
	// own: only MaxInFlight bounds them, and no per-caller state is kept.
	//
	// Requests WITHOUT a key are NOT subject to DefaultQuota: they may be
	// many different clients, and squeezing them all into one caller's
	// quota would refuse nearly all of them. They are bounded only by
	// MaxInFlight, unless Quotas[""] is set.
	DefaultQuota int64
	// Quotas overrides DefaultQuota for the listed API keys; every value
	// >= 1. The empty key "" is the keyless bucket: Quotas[""] = n caps ALL
	// requests without a key together at n at once (one shared bucket, not
	// n per client). Without it keyless requests have no quota.
	Quotas map[string]int64

	// Ramp, if set, is a slow start after the Shedder is created (or
	// RestartRamp is called): the effective limit is
	// min(MaxInFlight, current step). Every step must be <= MaxInFlight.
	Ramp *Ramp
	// Clock drives the ramp and the amplification-ratio window; nil means
	// the system clock (clock.System). A test can move a fake one by hand.
	// Deadlines are always compared with the system clock, since they are
	// applied to real contexts.
	Clock clock.Clock
	// Rand draws Retry-After values (with retry.FullJitter); nil means
	// math/rand/v2's global source. *math/rand/v2.Rand satisfies it; seed
	// one for reproducible tests. A Shedder serialises its calls, so a Rand
	// that is not safe for concurrent use is fine.
	Rand retry.Rand
	// Registerer receives the spillway_service_ metrics; nil means no
	// metrics.
	Registerer prometheus.Registerer
}

// withDefaults returns o with zero-valued optional fields set to defaults.
func (o Options) withDefaults() Options {
	if o.RetryAfterMin == 0 {
		o.RetryAfterMin = DefaultRetryAfterMin
	}
	if o.RetryAfterMax == 0 {
		o.RetryAfterMax = max(DefaultRetryAfterMax, 2*o.RetryAfterMin)
	}
	if o.CallerHeader == "" {
		o.CallerHeader = wire.DefaultCallerHeader
	}
	return o
}

// Validate returns an error naming the first invalid field by its Go name,
// or nil. Zero
// optional fields are checked with their defaults, as New applies them.
func (o Options) Validate() error {
	o = o.withDefaults()
	for _, check := range []func() error{o.validateLimits, o.validateRetryAfter, o.validateQuotas} {
		if err := check(); err != nil {
			return err
		}
	}
	if o.Ramp != nil {
		return o.Ramp.validate(o.MaxInFlight)
	}
	return nil
}

func (o Options) validateLimits() error {
	switch {
	case o.MaxInFlight < 1:
		return fmt.Errorf("MaxInFlight must be >= 1, got %d", o.MaxInFlight)
	case o.QueueSize < 0:
		return fmt.Errorf("QueueSize must be >= 0, got %d", o.QueueSize)
	case o.QueueTimeout < 0:
		return fmt.Errorf("QueueTimeout must be >= 0, got %v", o.QueueTimeout)
	case o.QueueSize > 0 && o.QueueTimeout == 0:
		return fmt.Errorf("QueueTimeout must be > 0 when QueueSize is %d", o.QueueSize)
	}
	return nil
}

func (o Options) validateRetryAfter() error {
	switch {
	case o.RetryAfterMin < time.Second:
		return fmt.Errorf("RetryAfterMin must be >= 1s, got %v", o.RetryAfterMin)
	case o.RetryAfterMin%time.Second != 0:
		return fmt.Errorf("RetryAfterMin must be a whole number of seconds, got %v", o.RetryAfterMin)
	case o.RetryAfterMax < time.Second:
		return fmt.Errorf("RetryAfterMax must be >= 1s, got %v", o.RetryAfterMax)
	case o.RetryAfterMax%time.Second != 0:
		return fmt.Errorf("RetryAfterMax must be a whole number of seconds, got %v", o.RetryAfterMax)
	case o.RetryAfterMax < o.RetryAfterMin:
		// Only reachable when both are set: an unset RetryAfterMax defaults
		// to at least RetryAfterMin, an unset RetryAfterMin to 1s.
		return fmt.Errorf("RetryAfterMax (%v) must be >= RetryAfterMin (%v)", o.RetryAfterMax, o.RetryAfterMin)
	}
	return nil
}

func (o Options) validateQuotas() error {
	if !validToken(o.CallerHeader) {
		return fmt.Errorf("CallerHeader must be an HTTP header name, got %q", o.CallerHeader)
	}
	if o.DefaultQuota < 0 {
		return fmt.Errorf("DefaultQuota must be >= 0, got %d", o.DefaultQuota)
	}
	for _, q := range o.Quotas {
		if q < 1 {
			// The key is an API key: keep it out of error messages and logs.
			return fmt.Errorf("Quotas must all be >= 1, got %d for one key", q)
		}
	}
	return nil
}

// validToken reports whether s is a non-empty RFC 9110 token, the syntax of
// a header name.
func validToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		isAlnum := c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z'
		if !isAlnum && !strings.ContainsRune("!#$%&'*+-.^_`|~", rune(c)) {
			return false
		}
	}
	return true
}
