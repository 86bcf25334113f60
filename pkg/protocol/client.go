package protocol

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/retry"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// Client runs the protocol's scripts for one dependency.
type Client struct {
	rdb  redis.UniversalClient
	dep  Dependency
	keys Keys

	acquireKeys []string
	releaseKeys []string
	renewKeys   []string
	leaseKeys   []string
	holdKeys    []string
	budgetKeys  []string
	windowKeys  []string
	publishKeys []string
	poolKeys    []string
}

// NewClient returns a Client for d over rdb, which may be a *redis.Client, a
// *redis.ClusterClient or a *redis.Ring.
func NewClient(rdb redis.UniversalClient, d Dependency) (*Client, error) {
	if rdb == nil {
		return nil, errors.New("redis client must not be nil")
	}
	if err := d.Validate(); err != nil {
		return nil, err
	}
	k := KeysFor(d)
	return &Client{
		rdb:         rdb,
		dep:         d,
		keys:        k,
		acquireKeys: []string{k.State, k.Leases, k.GCRA, k.Probes, k.Wants, k.Callers},
		// Every release passes the state and probes keys: a failure or
		// timeout may trip the breaker in the fleet's path (lib.lua trip).
		// and the calls hash counts this version's calls (lib.lua
		// count_version).
		releaseKeys: []string{k.Leases, k.Stats, k.State, k.Probes, k.Calls, k.Released},
		// renew puts back a lease Redis lost while the dependency learns,
		// which it reads in the state (lib.lua learning).
		renewKeys:   []string{k.Leases, k.State, k.Released},
		leaseKeys:   []string{k.Leases},
		holdKeys:    []string{k.State, k.Leases, k.Released},
		budgetKeys:  []string{k.State, k.Stats},
		windowKeys:  []string{k.State, k.Stats, k.Probes, k.Leases},
		publishKeys: []string{k.State, k.Probes},
		poolKeys:    []string{k.State, k.Leases, k.GCRA, k.Stats, k.Pools, k.Wants, k.Callers, k.Calls},
	}, nil
}

// Dependency is the dependency this client speaks for.
func (c *Client) Dependency() Dependency { return c.dep }

// Keys are the dependency's keys.
func (c *Client) Keys() Keys { return c.keys }

// Code says whether a call was admitted, and if not, why.
type Code int

const (
	// Admitted: the call holds a lease and may proceed.
	Admitted Code = 0
	// RefusedOpen: the breaker is open; Wait is the time until probes start.
	RefusedOpen Code = 1
	// RefusedThrottled: every slot is held, or, HalfOpen, every probe of
	// the epoch was admitted; Wait is the time until the first lease expires
	// (a bound, not a promise: a release frees one sooner), 0 for probes.
	RefusedThrottled Code = 2
	// RefusedRate: the rate limit is reached; Wait is when the next call may
	// start.
	RefusedRate Code = 3
	// RefusedSuperseded: a newer version of the job exists.
	RefusedSuperseded Code = 4
	// RefusedLate: the request reached Redis after its Deadline; nothing
	// was written. Its caller has given up on it, or should, and Now says
	// how far off the caller's idea of Redis time was.
	RefusedLate Code = 7
)

// String names the code.
func (c Code) String() string {
	switch c {
	case Admitted:
		return "admitted"
	case RefusedOpen:
		return "open"
	case RefusedThrottled:
		return "throttled"
	case RefusedRate:
		return "rate"
	case RefusedSuperseded:
		return "superseded"
	case RefusedLate:
		return "late"
	}
	return "code(" + strconv.Itoa(int(c)) + ")"
}

// AcquireArgs are the inputs of one acquisition.
type AcquireArgs struct {
	// LeaseID identifies the lease; unique per call (NewLeaseID).
	LeaseID string
	// TTL bounds how long a holder that dies keeps its slot.
	TTL time.Duration
	// JobKey and JobVersion, when JobKey is set, drop the call if a newer
	// version of the job is known, and record this version once admitted.
	JobKey     string
	JobVersion int64
	// JobTTL is how long the newest version of a job key is remembered.
	JobTTL time.Duration
	// Deadline, when set, is the latest Redis time at which the request may
	// still take a slot: a request that waited longer (behind a slow
	// script, or in the socket of a paused Redis) after its caller stopped
	// waiting for the reply is refused with RefusedLate and writes nothing,
	// so it leaves no lease that no call holds. It is Redis's clock, not
	// the caller's: estimate it from Admission.Now.
	Deadline time.Time
	// CallerID, when set, names the process (one stable id per process,
	// e.g. NewLeaseID once): a refusal for want of a slot then counts it as
	// a per-call contender of its own in the batching pools' fair split.
	// Callers without one count together as one contender.
	CallerID string
}

// Admission is the answer to an acquisition.
type Admission struct {
	Code Code
	// Epoch is the state epoch that admitted the call; release reports it so
	// that probe outcomes count only for the HalfOpen epoch they belong to.
	Epoch int64
	// Limit is the limit in force when the call was admitted or refused.
	Limit int64
	// Held is the number of leases held when a call was throttled.
	Held int64
	// Member is the lease's member in the leases sorted set: the lease id.
	Member string
	// State is the state that admitted the call.
	State wire.State
	// Wait is a hint for when to ask again (see Code).
	Wait time.Duration
	// Newest is the newest known version of a superseded job.
	Newest int64
	// Now is Redis's time when the script ran, in every reply that reached
	// it (not with ErrNoPolicy or ErrVersion).
	Now time.Time
}

// NewLeaseID returns a lease id unique with overwhelming probability: 128
// random bits in base 36.
func NewLeaseID() string {
	var b [32]byte
	s := strconv.AppendUint(b[:0], rand.Uint64(), 36)
	s = append(s, '-')
	s = strconv.AppendUint(s, rand.Uint64(), 36)
	return string(s)
}

// MaxJobVersion bounds job versions: Lua compares them as doubles.
const MaxJobVersion = 1<<53 - 1

// Acquire asks for one slot: breaker, dedupe, concurrency and rate are checked
// and the lease taken in one script, one round trip.
func (c *Client) Acquire(ctx context.Context, a AcquireArgs) (Admission, error) {
	if a.LeaseID == "" {
		return Admission{}, errors.New("lease id must not be empty")
	}
	if a.TTL < time.Millisecond {
		return Admission{}, fmt.Errorf("lease ttl must be at least 1ms, got %v", a.TTL)
	}
	keys := c.acquireKeys
	args := []any{a.LeaseID, a.TTL.Milliseconds(), millis(a.Deadline)}
	if a.JobKey != "" {
		if a.JobVersion < 0 || a.JobVersion > MaxJobVersion {
			return Admission{}, fmt.Errorf("job version must be in [0, 2^53), got %d", a.JobVersion)
		}
		if a.JobTTL < time.Millisecond {
			return Admission{}, fmt.Errorf("job ttl must be at least 1ms, got %v", a.JobTTL)
		}
		keys = []string{c.keys.State, c.keys.Leases, c.keys.GCRA, c.keys.Probes, c.keys.Wants, c.keys.Callers, c.keys.Job(a.JobKey)}
		args = append(args, a.JobVersion, a.JobTTL.Milliseconds())
	}
	if a.CallerID != "" {
		if a.JobKey == "" {
			args = append(args, "", "") // no job: ARGV[4] and ARGV[5] empty
		}
		args = append(args, a.CallerID)
	}
	res, err := acquireScript.Run(ctx, c.rdb, keys, args...).Slice()
	if err != nil {
		return Admission{}, fmt.Errorf("failed to acquire a slot for %s: %w", c.dep, err)
	}
	code, err := intAt(res, 0)
	if err != nil {
		return Admission{}, err
	}
	// Every reply that reached the policy ends with Redis's time in ms.
	var now time.Time
	if code != 5 && code != 6 {
		ms, err := intAt(res, len(res)-1)
		if err != nil {
			return Admission{}, err
		}
		now = time.UnixMilli(ms)
	}
	switch code {
	case 0:
		epoch, _ := intAt(res, 1)
		limit, _ := intAt(res, 2)
		state, _ := res[3].(string)
		return Admission{Code: Admitted, Epoch: epoch, Limit: limit, Member: a.LeaseID, State: wire.State(state), Now: now}, nil
	case 1:
		wait, _ := intAt(res, 1)
		return Admission{Code: RefusedOpen, Wait: time.Duration(wait) * time.Millisecond, Now: now}, nil
	case 2:
		wait, _ := intAt(res, 1)
		held, _ := intAt(res, 2)
		limit, _ := intAt(res, 3)
		return Admission{Code: RefusedThrottled, Wait: time.Duration(wait) * time.Millisecond, Held: held, Limit: limit, Now: now}, nil
	case 3:
		wait, _ := intAt(res, 1)
		return Admission{Code: RefusedRate, Wait: time.Duration(wait) * time.Millisecond, Now: now}, nil
	case 4:
		newest, _ := intAt(res, 1)
		return Admission{Code: RefusedSuperseded, Newest: newest, Now: now}, nil
	case 5:
		return Admission{}, fmt.Errorf("%s: %w", c.dep, ErrNoPolicy)
	case 6:
		return Admission{}, c.versionError(res)
	case 7:
		return Admission{Code: RefusedLate, Now: now}, nil
	}
	return Admission{}, fmt.Errorf("unexpected acquire reply %v", res)
}

// Renew extends a held lease by ttl from now. It returns false, and does not
// re-acquire, when the lease had already expired: the caller lost its slot.
func (c *Client) Renew(ctx context.Context, member string, ttl time.Duration) (bool, error) {
	if ttl < time.Millisecond {
		return false, fmt.Errorf("lease ttl must be at least 1ms, got %v", ttl)
	}
	n, err := renewScript.Run(ctx, c.rdb, c.renewKeys, member, ttl.Milliseconds()).Int64()
	if err != nil {
		return false, fmt.Errorf("failed to renew a lease for %s: %w", c.dep, err)
	}
	return n == 1, nil
}

// HoldEvery is how often a process that holds leases of its own (per-call
// permits) calls Hold: a fraction of learnFor, so that its leases are back
// before Redis admits anything new after losing them.
const HoldEvery = 250 * time.Millisecond

// ReplicationCheckEvery is how often, at most, the scripts read the
// server's replication id to find a failover or a restart out (lib.lua
// replid_every_ms). A failover that loses writes follows a crash that takes
// a second or more to detect, so the new master's first admission reads it.
const ReplicationCheckEvery = 100 * time.Millisecond

// LearnFor is how long a dependency learns once Redis lost leases (lib.lua
// learning): nothing new is admitted, and holders put back what they hold.
const LearnFor = time.Second

// Held is Hold's answer.
type Held struct {
	// Learning is the learning left; 0 when the dependency is not learning.
	Learning time.Duration
	// NoState is true when Redis holds no state for the dependency (lost
	// with its data, or never published): nobody admits, and the leases
	// were put back as while learning.
	NoState bool
	// PutBack counts the members that were missing and were put back.
	PutBack int64
	// Lost names the members the fleet no longer counts, outside learning
	// with a state: missing, or expired by Redis's clock. Their holder came
	// back after the learning second and another call may hold their slot;
	// their calls must stop, as after a renewal that found them lost.
	Lost []string
}

// Hold puts back the leases a process holds that Redis lost (docs/protocol.md
// §4 "Learning"): members are the leases of its running calls whose ttl has
// not passed by its own clock. Outside learning, with a state, it writes
// nothing. A process that holds leases calls it every HoldEvery; it also
// finds a failover out when nothing is acquired.
func (c *Client) Hold(ctx context.Context, members []string, ttl time.Duration) (Held, error) {
	if ttl < time.Millisecond {
		return Held{}, fmt.Errorf("lease ttl must be at least 1ms, got %v", ttl)
	}
	args := make([]any, 0, 1+len(members))
	args = append(args, ttl.Milliseconds())
	for _, m := range members {
		args = append(args, m)
	}
	res, err := holdScript.Run(ctx, c.rdb, c.holdKeys, args...).Slice()
	if err != nil {
		return Held{}, fmt.Errorf("failed to hold the leases of %s: %w", c.dep, err)
	}
	left, err1 := intAt(res, 0)
	n, err2 := intAt(res, 1)
	if err := errors.Join(err1, err2); err != nil {
		return Held{}, err
	}
	h := Held{PutBack: n}
	if len(res) > 2 {
		lost, ok := res[2].([]any)
		if !ok {
			return Held{}, fmt.Errorf("hold answered %T for the lost leases, want an array", res[2])
		}
		for _, m := range lost {
			s, ok := m.(string)
			if !ok {
				return Held{}, fmt.Errorf("hold answered %T for a lost lease, want a string", m)
			}
			h.Lost = append(h.Lost, s)
		}
	}
	if left < 0 {
		h.NoState = true
	} else {
		h.Learning = time.Duration(left) * time.Millisecond
	}
	return h, nil
}

// Release frees the lease member (empty for a call admitted without one) and
// reports the call's outcome and attempt number, in one round trip. epoch is
// the epoch that admitted the call; its outcome counts as a probe when that
// epoch is the current one and the state is HalfOpen. Pass 0 for a call not
// admitted HalfOpen to spare the script that check. A failure or timeout of a
// call that is not a probe may trip the breaker in the fleet's path: when
// the window the controller reads crosses the breaker's rule, the script
// publishes Open itself (docs/protocol.md, the in-path trip). It returns
// whether the member was still in the lease set: false means that a renew
// or a sweep had already removed it as expired. A lease that expired but was not swept yet
// reads true; whether a lease was lost is renew's answer, not release's.
func (c *Client) Release(ctx context.Context, member string, epoch int64, outcome Outcome, attempt int) (bool, error) {
	return c.ReleaseTimed(ctx, member, epoch, outcome, attempt, -1)
}

// ReleaseTimed is Release that also reports how long the call took (took
// >= 0; negative: not timed). A success's duration goes into the window's
// success latency (Window.MeanSuccessLatency), from which the controller
// bounds the rate of a ramp step.
func (c *Client) ReleaseTimed(ctx context.Context, member string, epoch int64, outcome Outcome, attempt int, took time.Duration) (bool, error) {
	if !outcome.Valid() {
		return false, fmt.Errorf("outcome must be s, f, t or c, got %q", outcome)
	}
	if attempt < 1 {
		return false, fmt.Errorf("attempt must be at least 1, got %d", attempt)
	}
	args := []any{member, string(outcome), attempt}
	if took >= 0 || epoch != 0 {
		args = append(args, epoch)
	}
	if took >= 0 {
		args = append(args, took.Microseconds())
	}
	n, err := releaseScript.Run(ctx, c.rdb, c.releaseKeys, args...).Int64()
	if err != nil {
		return false, fmt.Errorf("failed to release a lease for %s: %w", c.dep, err)
	}
	return n == 1, nil
}

// Forget makes the lease member stop counting: the lease of an acquisition
// whose reply was never read (its round trip timed out, its caller
// cancelled, its connection broke). It works whether that acquisition
// already ran or is still queued in Redis behind it: the member is written
// with an expired score, and acquire adds members only when they are new
// (ZADD NX), so a late acquisition cannot bring it back. Idempotent; the
// expired member is swept like any other.
func (c *Client) Forget(ctx context.Context, member string) error {
	if member == "" {
		return errors.New("lease member must not be empty")
	}
	if err := forgetScript.Run(ctx, c.rdb, c.leaseKeys, member).Err(); err != nil {
		return fmt.Errorf("failed to forget a lease for %s: %w", c.dep, err)
	}
	return nil
}

// BudgetDecision is the answer to "may this failed job retry now?".
type BudgetDecision struct {
	Allowed bool
	// Grants is how many retries this decision granted: 0 or 1 from
	// RetryBudget, up to n from RetryBudgetN.
	Grants int64
	// Backoff is the policy's backoff as published now.
	Backoff retry.Backoff
	// Calls and Granted are the calls and retries counted in the window,
	// before this decision.
	Calls, Granted int64
}

// RetryBudget decides whether one more retry fits the fleet's budget and
// counts the grant or the refusal. It also returns the backoff parameters in
// force, so a policy change applies at the next failure.
func (c *Client) RetryBudget(ctx context.Context) (BudgetDecision, error) {
	return c.retryBudget(ctx)
}

// RetryBudgetN asks for n retries at once (a process's batch) and grants
// what n one-at-a-time RetryBudget decisions would have granted: the
// retries that keep the budget rule true, never more. It counts the grants
// and the n − Grants refusals.
func (c *Client) RetryBudgetN(ctx context.Context, n int64) (BudgetDecision, error) {
	if n < 1 {
		return BudgetDecision{}, fmt.Errorf("retries asked must be at least 1, got %d", n)
	}
	return c.retryBudget(ctx, n)
}

func (c *Client) retryBudget(ctx context.Context, args ...any) (BudgetDecision, error) {
	res, err := budgetScript.Run(ctx, c.rdb, c.budgetKeys, args...).Slice()
	if err != nil {
		return BudgetDecision{}, fmt.Errorf("failed to check the retry budget for %s: %w", c.dep, err)
	}
	code, err := intAt(res, 0)
	if err != nil {
		return BudgetDecision{}, err
	}
	switch code {
	case -5:
		return BudgetDecision{}, fmt.Errorf("%s: %w", c.dep, ErrNoPolicy)
	case -6:
		return BudgetDecision{}, c.versionError(res)
	}
	if len(res) != 6+len(args) {
		return BudgetDecision{}, fmt.Errorf("unexpected budget reply %v", res)
	}
	base, _ := intAt(res, 1)
	maxMS, _ := intAt(res, 2)
	jitter, _ := res[3].(string)
	calls, _ := intAt(res, 4)
	granted, _ := intAt(res, 5)
	grants := int64(0)
	if code == 1 {
		grants = 1
	}
	if len(args) > 0 {
		if grants, err = intAt(res, 6); err != nil {
			return BudgetDecision{}, err
		}
	}
	return BudgetDecision{
		Allowed: code == 1,
		Grants:  grants,
		Backoff: retry.Backoff{
			Base:   time.Duration(base) * time.Millisecond,
			Max:    time.Duration(maxMS) * time.Millisecond,
			Jitter: retry.Jitter(jitter),
		},
		Calls:   calls,
		Granted: granted,
	}, nil
}

// Supersede records that version of jobKey exists, so that older versions are
// dropped before they call the dependency. It returns the newest version known.
func (c *Client) Supersede(ctx context.Context, jobKey string, version int64, ttl time.Duration) (int64, error) {
	if jobKey == "" {
		return 0, errors.New("job key must not be empty")
	}
	if version < 0 || version > MaxJobVersion {
		return 0, fmt.Errorf("job version must be in [0, 2^53), got %d", version)
	}
	if ttl < time.Millisecond {
		return 0, fmt.Errorf("job ttl must be at least 1ms, got %v", ttl)
	}
	s, err := supersedeScript.Run(ctx, c.rdb, []string{c.keys.Job(jobKey)}, version, ttl.Milliseconds()).Text()
	if err != nil {
		return 0, fmt.Errorf("failed to record job %q version %d for %s: %w", jobKey, version, c.dep, err)
	}
	return strconv.ParseInt(s, 10, 64)
}

// Noop runs a script that does nothing: the baseline the acquire benchmark is
// measured against.
func (c *Client) Noop(ctx context.Context) error {
	return noopScript.Run(ctx, c.rdb, c.leaseKeys).Err()
}

func intAt(res []any, i int) (int64, error) {
	if i >= len(res) {
		return 0, fmt.Errorf("reply %v has no element %d", res, i)
	}
	switch v := res[i].(type) {
	case int64:
		return v, nil
	case string:
		return strconv.ParseInt(v, 10, 64)
	}
	return 0, fmt.Errorf("reply element %d is %T, not an integer", i, res[i])
}

// millis converts t to Unix milliseconds, 0 for the zero time.
func millis(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixMilli()
}

// fromMillis is the inverse of millis.
func fromMillis(ms int64) time.Time {
	if ms == 0 {
		return time.Time{}
	}
	return time.UnixMilli(ms)
}

// seconds rounds d up to whole seconds, at least 1.
func seconds(d time.Duration) int64 {
	s := int64(math.Ceil(d.Seconds()))
	if s < 1 {
		return 1
	}
	return s
}
