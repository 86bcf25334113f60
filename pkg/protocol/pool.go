package protocol

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/spillway-dev/spillway/pkg/wire"
)

// MaxPoolMembers bounds the members one pool call may name (held plus
// returned): Lua 5.1 unpacks at most about 8000 values at a time.
const MaxPoolMembers = 4000

// SplitEvery is how often, at most, pool computes the fair split again
// (pool.lua split_every_ms): shares lag the contenders by at most this much.
const SplitEvery = 50 * time.Millisecond

// ErrLate means a pool request reached Redis after its deadline: nothing was
// written, nothing granted, its report not counted. The pool sends its
// report again with its next request.
var ErrLate = errors.New("the request ran after its deadline")

// Report is an aggregated outcome report: the counters a release writes,
// summed over the calls a process ended since its last report. A pool call
// adds them to the current second's counters, so the window the controller
// reads is the one per-call releases would have written.
type Report struct {
	Successes, Failures, Timeouts int64
	// ByAttempt counts the calls by attempt number: 1, 2, 3, and 4 or more.
	ByAttempt [4]int64
	// SuccessMicros and TimedSuccesses sum the durations, in whole
	// microseconds, and count the successes whose duration was measured.
	SuccessMicros, TimedSuccesses int64
}

// Add counts one call's outcome as release would: a cancelled call counts
// nothing, the attempt is clamped to [1, 4], and a success's duration (took
// >= 0; negative: not timed) is summed in whole microseconds.
func (r *Report) Add(o Outcome, attempt int, took time.Duration) {
	switch o {
	case Success:
		r.Successes++
		if took >= 0 {
			r.SuccessMicros += took.Microseconds()
			r.TimedSuccesses++
		}
	case Failure:
		r.Failures++
	case Timeout:
		r.Timeouts++
	default:
		return
	}
	r.ByAttempt[min(max(attempt, 1), 4)-1]++
}

// Merge adds o's counts to r.
func (r *Report) Merge(o Report) {
	r.Successes += o.Successes
	r.Failures += o.Failures
	r.Timeouts += o.Timeouts
	for i := range r.ByAttempt {
		r.ByAttempt[i] += o.ByAttempt[i]
	}
	r.SuccessMicros += o.SuccessMicros
	r.TimedSuccesses += o.TimedSuccesses
}

// IsZero reports whether r counts nothing.
func (r Report) IsZero() bool { return r == Report{} }

// Calls is the number of calls r counts.
func (r Report) Calls() int64 { return r.Successes + r.Failures + r.Timeouts }

// PoolArgs are the inputs of one pool refresh.
type PoolArgs struct {
	// PoolID identifies the pool: one per process (NewLeaseID). Its members
	// are "<PoolID>:<n>".
	PoolID string
	// RequestID identifies this request: a resend with the same id (after a
	// lost reply) is answered with the first run's reply and writes nothing
	// again. A pool sends a new id for each new request, and the same id
	// again until it has read the reply.
	RequestID string
	// Deadline, when set, is the latest Redis time at which the request may
	// still run: a request that waited longer (behind a slow script, or in
	// the socket of a paused Redis) is refused with ErrLate and writes
	// nothing, so it grants no slot that no call uses. A resend of a
	// request that ran is answered whatever its deadline. Estimate it from
	// PoolReply.Now.
	Deadline time.Time
	// TTL is the expiry of every held and granted member: a process that
	// dies loses its slots at most TTL after its last refresh. Members are
	// renewed to now + TTL once less than TTL/2 is left, so a pool
	// refreshes more often than every TTL/2.
	TTL time.Duration
	// Held are the members the pool still holds (in use or idle): they are
	// renewed; the ones that expired come back in PoolReply.Lost.
	Held []string
	// Return are the members the pool gives back; they stop counting now.
	Return []string
	// Want is the number of slots the process could use now: its calls in
	// flight plus its waiting calls. It is the pool's demand in the fair
	// share.
	Want int64
	// Tokens is the number of rate tokens wanted; 0 for none.
	Tokens int64
	// TokenLead is the least time a granted token stays usable after the
	// script ran: the pool's round trip, as a margin. Rates whose tokens
	// would live shorter (burst 1, below 20 calls/s) grant no tokens.
	TokenLead time.Duration
	// Report is the outcome report since the last acknowledged one.
	Report Report
}

// RateTokens are rate tokens granted to a pool. Token j (0 <= j < Count) is
// due at First + j × Interval and may start one call at any time in
// [due − Spread, due] (Redis time): each token is a per-call admission
// taken in advance, so the fleet's rate bound holds across both modes. An
// Interval of 0 means the dependency has no rate limit.
type RateTokens struct {
	Count    int64
	First    time.Time
	Interval time.Duration
	Spread   time.Duration
}

// Window is when token j may start a call, in Redis time.
func (t RateTokens) Window(j int64) (from, until time.Time) {
	due := t.First.Add(time.Duration(j) * t.Interval)
	return due.Add(-t.Spread), due
}

// PoolReply is the answer to a pool refresh.
type PoolReply struct {
	// Epoch, State and Limit are the published state in force.
	Epoch int64
	State wire.State
	Limit int64
	// OpenUntil is when an Open breaker lets probes through (zero: unset).
	OpenUntil time.Time
	// Now is Redis's time when the script ran.
	Now time.Time
	// Stale is true when the state is Open or HalfOpen and no controller has
	// published for the dead-man bound: the pool gets no slots, and calls
	// go per-call, where acquire admits the dead-man rule's probes.
	Stale bool
	// Share is the pool's fair share of the limit (docs/protocol.md §4
	// pool): 0 while Open, HalfOpen or Stale.
	Share int64
	// Excess is how many slots the pool must give back, idle ones first and
	// the others as their calls end: the slots above its share when another
	// contender waits, those a lowered limit took away, and every slot
	// while Open, HalfOpen or Stale.
	Excess int64
	// Granted are the new members; they count in the fleet's cap until
	// returned or expired.
	Granted []string
	// Lost are the held members that had expired: the fleet no longer counts
	// them and the calls that used them must end as lost leases.
	Lost []string
	// Tokens are the rate tokens granted.
	Tokens RateTokens
}

// Batching reports whether the state lets pools hold slots: Closed or
// Ramping. Otherwise the process drops its pool and calls go per-call.
func (r PoolReply) Batching() bool {
	return r.State == wire.Closed || r.State == wire.Ramping
}

// Pool refreshes the pool a.PoolID in one round trip: it renews a.Held,
// takes back a.Return, counts a.Report, and grants new members and rate
// tokens up to what is free and the pool's fair share. A report that holds
// failures or timeouts may trip the breaker in the fleet's path, as a
// release does (docs/protocol.md, the in-path trip); the reply then answers
// the Open the trip wrote.
func (c *Client) Pool(ctx context.Context, a PoolArgs) (PoolReply, error) {
	if a.PoolID == "" || a.RequestID == "" {
		return PoolReply{}, errors.New("pool id and request id must not be empty")
	}
	if strings.ContainsAny(a.PoolID, ": ") {
		return PoolReply{}, fmt.Errorf("pool id %q must not contain ':' or ' '", a.PoolID)
	}
	if a.TTL < time.Millisecond {
		return PoolReply{}, fmt.Errorf("lease ttl must be at least 1ms, got %v", a.TTL)
	}
	if a.Want < 0 || a.Tokens < 0 || a.TokenLead < 0 {
		return PoolReply{}, fmt.Errorf("want, tokens and token lead must be >= 0, got %d, %d and %v", a.Want, a.Tokens, a.TokenLead)
	}
	if n := len(a.Held) + len(a.Return); n > MaxPoolMembers {
		return PoolReply{}, fmt.Errorf("a pool call names at most %d members, got %d", MaxPoolMembers, n)
	}
	r := a.Report
	args := make([]any, 0, 18+len(a.Held)+len(a.Return))
	args = append(args, a.PoolID, a.RequestID, millis(a.Deadline), a.TTL.Milliseconds(), a.Want, a.Tokens, a.TokenLead.Microseconds(),
		len(a.Held), len(a.Return),
		r.Successes, r.Failures, r.Timeouts, r.ByAttempt[0], r.ByAttempt[1], r.ByAttempt[2], r.ByAttempt[3],
		r.SuccessMicros, r.TimedSuccesses)
	for _, m := range a.Held {
		args = append(args, m)
	}
	for _, m := range a.Return {
		args = append(args, m)
	}
	res, err := poolScript.Run(ctx, c.rdb, c.poolKeys, args...).Slice()
	if err != nil {
		return PoolReply{}, fmt.Errorf("failed to refresh pool %s of %s: %w", a.PoolID, c.dep, err)
	}
	return c.parsePool(res)
}

// parsePool decodes pool.lua's reply.
func (c *Client) parsePool(res []any) (PoolReply, error) {
	code, err := intAt(res, 0)
	if err != nil {
		return PoolReply{}, err
	}
	switch code {
	case 5:
		return PoolReply{}, fmt.Errorf("%s: %w", c.dep, ErrNoPolicy)
	case 6:
		return PoolReply{}, c.versionError(res)
	case 7:
		ms, err := intAt(res, 1)
		if err != nil {
			return PoolReply{}, err
		}
		return PoolReply{Now: time.UnixMilli(ms)}, fmt.Errorf("%s at %v: %w", c.dep, time.UnixMilli(ms), ErrLate)
	}
	if code != 0 || len(res) != 15 {
		return PoolReply{}, fmt.Errorf("unexpected pool reply %v", res)
	}
	var n [15]int64
	for _, i := range []int{1, 3, 4, 5, 6, 7, 8, 11, 12, 13, 14} {
		if n[i], err = intAt(res, i); err != nil {
			return PoolReply{}, err
		}
	}
	state, _ := res[2].(string)
	granted, err := stringSlice(res[9])
	if err != nil {
		return PoolReply{}, err
	}
	lost, err := stringSlice(res[10])
	if err != nil {
		return PoolReply{}, err
	}
	return PoolReply{
		Epoch:     n[1],
		State:     wire.State(state),
		Limit:     n[3],
		OpenUntil: fromMillis(n[4]),
		Now:       time.UnixMilli(n[5]),
		Stale:     n[6] == 1,
		Share:     n[7],
		Excess:    n[8],
		Granted:   granted,
		Lost:      lost,
		Tokens: RateTokens{
			Count:    n[11],
			First:    fromMicros(n[12]),
			Interval: time.Duration(n[13]) * time.Microsecond,
			Spread:   time.Duration(n[14]) * time.Microsecond,
		},
	}, nil
}

// stringSlice converts a reply's array of bulk strings.
func stringSlice(v any) ([]string, error) {
	a, ok := v.([]any)
	if !ok {
		return nil, fmt.Errorf("reply element %v is %T, not an array", v, v)
	}
	out := make([]string, 0, len(a))
	for _, e := range a {
		s, ok := e.(string)
		if !ok {
			return nil, fmt.Errorf("reply element %v is %T, not a string", e, e)
		}
		out = append(out, s)
	}
	return out, nil
}

// fromMicros is Unix microseconds as a time, the zero time for 0.
func fromMicros(us int64) time.Time {
	if us == 0 {
		return time.Time{}
	}
	return time.UnixMicro(us)
}
