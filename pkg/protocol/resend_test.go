package protocol_test

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// A client library resends a command whose reply it lost (go-redis's
// MaxRetries, redis-py's retry_on_error): every script must be idempotent per
// lease id (docs/protocol.md, "Resends"). These tests run each script twice
// with the same arguments, as such a resend does, on a real Redis.

// TestAcquireResendAnswersAsTheFirstRun: a resent acquisition finds its own
// lease and answers admitted, with the same epoch and limit, taking no second
// slot, no rate token and no second probe, even where a fresh acquisition
// would now be refused.
func TestAcquireResendAnswersAsTheFirstRun(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		// publish is the state the first run sees; between, when set, is
		// published between the first run and the resend.
		publish, between func(rdb redis.UniversalClient) protocol.Published
		// lateResend sends the resend past the request's deadline.
		lateResend bool
		// want is the resend's epoch, limit and state.
		wantEpoch, wantLimit int64
		wantState            wire.State
	}{{
		name:      "closed at the limit",
		publish:   func(redis.UniversalClient) protocol.Published { return policy(1) },
		wantEpoch: 1, wantLimit: 1, wantState: wire.Closed,
	}, {
		name: "rate spent",
		publish: func(redis.UniversalClient) protocol.Published {
			p := policy(5)
			p.RatePerSecond = 1
			return p
		},
		wantEpoch: 1, wantLimit: 5, wantState: wire.Closed,
	}, {
		name: "resend past the request's deadline",
		publish: func(redis.UniversalClient) protocol.Published {
			return policy(1)
		},
		lateResend: true,
		wantEpoch:  1, wantLimit: 1, wantState: wire.Closed,
	}, {
		name: "halfopen probe",
		publish: func(redis.UniversalClient) protocol.Published {
			p := policy(1)
			p.Capacity, p.State, p.Epoch = 40, wire.HalfOpen, 4
			return p
		},
		wantEpoch: 4, wantLimit: 1, wantState: wire.HalfOpen,
	}, {
		name:    "opened between the runs",
		publish: func(redis.UniversalClient) protocol.Published { return policy(1) },
		between: func(rdb redis.UniversalClient) protocol.Published {
			p := policy(1)
			p.State, p.Epoch, p.OpenUntil = wire.Open, 2, time.Now().Add(time.Minute)
			return p
		},
		wantEpoch: 2, wantLimit: 1, wantState: wire.Open,
	}, {
		name:    "a HalfOpen epoch began between the runs: not its probe",
		publish: func(redis.UniversalClient) protocol.Published { return policy(1) },
		between: func(rdb redis.UniversalClient) protocol.Published {
			p := policy(1)
			p.Capacity, p.State, p.Epoch = 40, wire.HalfOpen, 3
			return p
		},
		wantEpoch: 0, wantLimit: 1, wantState: wire.HalfOpen,
	}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
				c := newClient(t, rdb)
				mustPublish(t, c, tc.publish(rdb))
				args := protocol.AcquireArgs{LeaseID: leaseID(), TTL: 30 * time.Second, JobKey: "order-7", JobVersion: 2, JobTTL: time.Minute}
				args.Deadline = redisNow(t, rdb).Add(time.Second)
				first, err := c.Acquire(ctxT(t), args)
				if err != nil || first.Code != protocol.Admitted {
					t.Fatalf("first run = %+v, %v, want admitted", first, err)
				}
				if tc.between != nil {
					mustPublish(t, c, tc.between(rdb))
				}
				if tc.lateResend {
					args.Deadline = redisNow(t, rdb).Add(-time.Second)
				}
				again, err := c.Acquire(ctxT(t), args)
				if err != nil {
					t.Fatalf("resend: %v", err)
				}
				if again.Code != protocol.Admitted || again.Member != first.Member ||
					again.Epoch != tc.wantEpoch || again.Limit != tc.wantLimit || again.State != tc.wantState {
					t.Fatalf("resend = %+v, want admitted, member %s, epoch %d, limit %d, state %s (first run %+v)",
						again, first.Member, tc.wantEpoch, tc.wantLimit, tc.wantState, first)
				}
				if n := liveLeases(t, rdb, c); n != 1 {
					t.Errorf("the first run and its resend hold %d live leases, want 1", n)
				}
				if tc.wantState == wire.HalfOpen && tc.wantEpoch != 0 {
					n, err := rdb.HGet(ctxT(t), c.Keys().Probes, "admitted").Int64()
					if err != nil || n != 1 {
						t.Errorf("probes admitted after a resent probe = %d, %v, want 1", n, err)
					}
				}
			})
		})
	}
}

// TestAcquireResendDoesNotReviveAForgottenLease: a lease the forgetter wrote
// off stays expired when its acquisition is run again.
func TestAcquireResendDoesNotReviveAForgottenLease(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		mustPublish(t, c, policy(1))
		args := protocol.AcquireArgs{LeaseID: leaseID(), TTL: 30 * time.Second}
		if a, err := c.Acquire(ctxT(t), args); err != nil || a.Code != protocol.Admitted {
			t.Fatalf("Acquire = %+v, %v", a, err)
		}
		if err := c.Forget(ctxT(t), args.LeaseID); err != nil {
			t.Fatalf("Forget: %v", err)
		}
		if _, err := c.Acquire(ctxT(t), args); err != nil {
			t.Fatalf("resend: %v", err)
		}
		if n := liveLeases(t, rdb, c); n != 0 {
			t.Errorf("a resend revived a forgotten lease: %d live leases", n)
		}
	})
}

// TestReleaseResendCountsOnce: a resent release finds its lease gone and
// counts nothing: no outcome, no attempt, no probe.
func TestReleaseResendCountsOnce(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		state   wire.State
		outcome protocol.Outcome
		attempt int
	}{
		{"closed failure", wire.Closed, protocol.Failure, 1},
		{"closed success on a retry", wire.Closed, protocol.Success, 3},
		{"closed timeout", wire.Closed, protocol.Timeout, 2},
		{"probe failure", wire.HalfOpen, protocol.Failure, 1},
		{"probe cancelled", wire.HalfOpen, protocol.Cancelled, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
				c := newClient(t, rdb)
				p := policy(2)
				p.Capacity, p.State, p.Epoch = 40, tc.state, 5
				mustPublish(t, c, p)
				a := mustAdmit(t, c, 30*time.Second)
				if !mustRelease(t, c, a, tc.outcome, tc.attempt) {
					t.Fatalf("the first release found no lease")
				}
				if mustRelease(t, c, a, tc.outcome, tc.attempt) {
					t.Fatalf("the resent release found the lease again")
				}
				w, probes := mustWindow(t, c, time.Minute, time.Time{})
				want := protocol.Window{}
				switch tc.outcome {
				case protocol.Success:
					want.Successes = 1
				case protocol.Failure:
					want.Failures = 1
				case protocol.Timeout:
					want.Timeouts = 1
				}
				if tc.outcome != protocol.Cancelled {
					want.Calls = 1
					want.ByAttempt[min(tc.attempt, 4)-1] = 1
				}
				if w != want {
					t.Errorf("window after a release and its resend = %+v, want %+v", w, want)
				}
				if tc.state == wire.HalfOpen {
					wantProbes := protocol.Probes{}
					if tc.outcome == protocol.Failure {
						wantProbes.Failures = 1
					}
					if probes != wantProbes {
						t.Errorf("probes after a release and its resend = %+v, want %+v", probes, wantProbes)
					}
					admitted, _ := rdb.HGet(ctxT(t), c.Keys().Probes, "admitted").Int64()
					wantAdmitted := int64(1)
					if tc.outcome == protocol.Cancelled {
						wantAdmitted = 0 // given back once, not twice
					}
					if admitted != wantAdmitted {
						t.Errorf("probes admitted = %d, want %d", admitted, wantAdmitted)
					}
				}
			})
		})
	}
}

// TestRenewForgetSupersedeResendAreHarmless: renew, forget and supersede run
// twice leave what one run leaves.
func TestRenewForgetSupersedeResendAreHarmless(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		mustPublish(t, c, policy(2))
		a := mustAdmit(t, c, 30*time.Second)
		for i := range 2 {
			held, err := c.Renew(ctxT(t), a.Member, 30*time.Second)
			if err != nil || !held {
				t.Fatalf("renew %d = %v, %v, want held", i+1, held, err)
			}
		}
		if n := liveLeases(t, rdb, c); n != 1 {
			t.Errorf("renewed twice: %d live leases, want 1", n)
		}
		for i := range 2 {
			if err := c.Forget(ctxT(t), a.Member); err != nil {
				t.Fatalf("forget %d: %v", i+1, err)
			}
		}
		if n := liveLeases(t, rdb, c); n != 0 {
			t.Errorf("forgotten twice: %d live leases, want 0", n)
		}
		for i := range 2 {
			newest, err := c.Supersede(ctxT(t), "order-9", 4, time.Minute)
			if err != nil || newest != 4 {
				t.Fatalf("supersede %d = %d, %v, want 4", i+1, newest, err)
			}
		}
		if b := mustAcquire(t, c, time.Second); b.Code != protocol.Admitted {
			t.Errorf("after the resends a fresh call = %+v, want admitted", b)
		}
	})
}
