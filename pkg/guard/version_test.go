package guard_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// unservedState is a published state of a version this worker does not act
// on, faked as TestVersionRefusalNamesBothVersions (pkg/protocol) fakes it:
// the state hash's "version" (the state version), and the manager's
// version when that manager wrote one.
type unservedState struct {
	name    string
	state   int
	manager int // 0: not written (a manager of version 4 or older)
	// message is what the error must say: the state's version, the
	// manager's (or that it is unknown), this worker's, and what to do.
	message []string
}

func unservedStates() []unservedState {
	v := protocol.Version
	return []unservedState{
		{name: "too new", state: protocol.MaxStateVersion + 1, manager: v + 2, message: []string{
			"a manager at protocol version " + strconv.Itoa(v+2),
			"for workers at protocol version " + strconv.Itoa(protocol.MaxStateVersion+1) + " or later",
			"this worker speaks version " + strconv.Itoa(v),
			"upgrade this worker's Spillway library",
			"docs/operations.md, Upgrading",
		}},
		{name: "too old", state: protocol.MinStateVersion - 1, manager: v - 2, message: []string{
			"a manager at protocol version " + strconv.Itoa(v-2),
			"for workers at protocol version " + strconv.Itoa(protocol.MinStateVersion-1) + " or later",
			"this worker speaks version " + strconv.Itoa(v),
			"upgrade the Spillway manager",
		}},
		{name: "too old, manager unknown", state: protocol.MinStateVersion - 1, message: []string{
			"a manager of an unknown protocol version",
			"for workers at protocol version " + strconv.Itoa(protocol.MinStateVersion-1) + " or later",
			"this worker speaks version " + strconv.Itoa(v),
			"upgrade the Spillway manager",
		}},
	}
}

// fake rewrites the published state's version fields to s's.
func (s unservedState) fake(t *testing.T, rdb redis.UniversalClient) {
	t.Helper()
	d, err := protocol.ParseDependency(dep)
	if err != nil {
		t.Fatal(err)
	}
	c, err := protocol.NewClient(rdb, d)
	if err != nil {
		t.Fatal(err)
	}
	p, _, err := c.ReadPublished(t.Context())
	if err != nil {
		t.Fatalf("read the published state: %v", err)
	}
	key := c.Keys().State
	if s.manager == 0 {
		err = rdb.HDel(t.Context(), key, "manager_version", "manager_seq").Err()
		if err == nil {
			err = rdb.HSet(t.Context(), key, "version", s.state).Err()
		}
	} else {
		err = rdb.HSet(t.Context(), key, "version", s.state, "manager_version", s.manager, "manager_seq", p.Seq).Err()
	}
	if err != nil {
		t.Fatal(err)
	}
}

// wantVersionError checks that err is the guard's refusal for s: deferred,
// errors.Is ErrVersion, and a *protocol.VersionError whose message names
// both versions and what to do.
func wantVersionError(t *testing.T, err error, s unservedState) {
	t.Helper()
	after := wantDecision(t, err, guard.ActionDefer, guard.ErrVersion)
	if after <= 0 {
		t.Errorf("deferred with no delay: %v", err)
	}
	if errors.Is(err, guard.ErrNoPolicy) {
		t.Errorf("%v: also matches ErrNoPolicy; a policy is published, under another version", err)
	}
	var ve *protocol.VersionError
	if !errors.As(err, &ve) {
		t.Fatalf("%v: no *protocol.VersionError in the chain", err)
	}
	wantManager := s.manager
	if wantManager == 0 {
		wantManager = -1
	}
	if ve.State != s.state || ve.Manager != wantManager || ve.Dependency.String() != dep {
		t.Errorf("VersionError{Dependency %s, State %d, Manager %d}, want %s, %d and %d", ve.Dependency, ve.State, ve.Manager, dep, s.state, wantManager)
	}
	for _, want := range s.message {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%q does not say %q", err.Error(), want)
		}
	}
}

// TestDoRefusesAStateOfAnUnservedVersion: against a dependency whose state
// was published for a protocol version this worker does not act on (too
// new or too old), Do and Acquire never call the dependency and defer the
// job with guard.ErrVersion, whose message names both versions and what to
// upgrade, in both modes; the refusals are counted under reason "version".
// Once the manager publishes a version this worker acts on, calls go
// through again.
func TestDoRefusesAStateOfAnUnservedVersion(t *testing.T) {
	for _, s := range unservedStates() {
		t.Run(s.name, func(t *testing.T) {
			inModes(t, func(t *testing.T, batch guard.BatchOptions) {
				g := NewWithT(t)
				rdb := fastClient(redistest.Start(t))
				publish(t, rdb, defaultPublished(5))
				s.fake(t, rdb)
				reg := prometheus.NewRegistry()
				gd := newGuard(t, rdb, guard.Options{Batch: batch, Registerer: reg})

				var called atomic.Int64
				fn := func(context.Context) error { called.Add(1); return nil }
				for range 3 {
					wantVersionError(t, gd.Do(t.Context(), guard.Job{}, fn), s)
				}
				p, err := gd.Acquire(t.Context(), guard.Job{})
				if p != nil {
					t.Errorf("Acquire admitted a call under a state of version %d", s.state)
					_ = p.Done(nil)
				}
				wantVersionError(t, err, s)
				g.Expect(called.Load()).To(BeZero(), "the dependency was called")
				g.Expect(testutil.ToFloat64(counter(t, reg, "spillway_worker_throttled_total", "reason", "version"))).To(Equal(4.0))

				// The manager publishes a version this worker acts on.
				publish(t, rdb, defaultPublished(5))
				g.Eventually(func() error { return gd.Do(t.Context(), guard.Job{}, fn) }).
					WithTimeout(5 * time.Second).WithPolling(20 * time.Millisecond).Should(Succeed())
				g.Expect(called.Load()).To(BeNumerically(">=", 1))
			})
		})
	}
}

// TestFailedCallUnderAnUnservedVersionSaysSo: a call that fails after the
// state turned to a version this worker does not act on (a manager two
// versions newer took over while it ran) cannot ask the retry budget, whose
// script refuses the state as acquire does. The job's error must still say
// why, as a refusal does: errors.Is ErrVersion, naming both versions and
// what to upgrade, not a bare "retry budget exhausted" (the fleet's budget
// is not spent) counted as a Redis error (Redis answered).
//
// It failed (in both modes) before decideRetry (permit.go) told a refusal
// from Redis being down: it parked the job for the long delay as
// ErrBudgetExhausted with the call's error as its Cause, dropped the
// *protocol.VersionError and counted a Redis error.
func TestFailedCallUnderAnUnservedVersionSaysSo(t *testing.T) {
	s := unservedStates()[0]
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		rdb := fastClient(redistest.Start(t))
		publish(t, rdb, defaultPublished(5))
		reg := prometheus.NewRegistry()
		gd := newGuard(t, rdb, guard.Options{Batch: batch, Registerer: reg})
		err := gd.Do(t.Context(), guard.Job{}, func(context.Context) error {
			s.fake(t, rdb)
			return errors.New("boom")
		})
		if !errors.Is(err, guard.ErrVersion) {
			t.Errorf("a failed call under a state of version %d = %v; want an error matching guard.ErrVersion", s.state, err)
		}
		for _, want := range s.message {
			if err != nil && !strings.Contains(err.Error(), want) {
				t.Errorf("%q does not say %q", err.Error(), want)
			}
		}
		if n := testutil.ToFloat64(counter(t, reg, "spillway_worker_redis_errors_total")); n != 0 {
			t.Errorf("%v Redis errors counted; Redis answered", n)
		}
	})
}

// TestBatchPoolGivesItsSlotsBackUnderAnUnservedVersion: a batching process
// holding slots when the state turns to a version it does not act on (the
// manager rolled to a version outside the skew) stops taking local slots
// within a refresh, defers its calls with ErrVersion, and gives its idle
// slots back, as it does when the breaker opens: left in Redis, they would
// hold part of the limit of the workers that are served for a lease TTL.
//
// It fails today: the pool drops its slots and defers, but its slots stay
// held in Redis (3 of a limit of 5) until their leases expire, because
// pool.lua answers the version refusal before it handles the members the
// request gives back (and the process sends no release for them). The Lua
// and pkg/guard's code are the lead's to change: skipped until fixed.
func TestBatchPoolGivesItsSlotsBackUnderAnUnservedVersion(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	publish(t, rdb, defaultPublished(5))
	reg := prometheus.NewRegistry()
	gd := newGuard(t, rdb, guard.Options{Registerer: reg, Batch: guard.BatchOptions{Enabled: true}})
	slots := func() float64 { return gauge(t, reg, "spillway_worker_batch_slots") }
	var f inFlight
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	ran, errs := load(ctx, gd, 3, f.call(20*time.Millisecond))()
	g.Expect(errs).To(BeEmpty())
	g.Expect(ran).To(BeNumerically(">", 0))
	g.Expect(slots()).To(BeNumerically(">=", 1), "the pool holds slots")
	g.Expect(liveLeases(t, rdb, gd)).To(BeNumerically(">=", 1), "Redis counts the pool's slots")

	s := unservedStates()[0]
	s.fake(t, rdb)
	g.Eventually(func() error { return gd.Do(t.Context(), guard.Job{}, ok) }).WithTimeout(time.Second).
		WithPolling(5 * time.Millisecond).Should(MatchError(guard.ErrVersion))
	wantVersionError(t, gd.Do(t.Context(), guard.Job{}, ok), s)
	g.Eventually(slots).WithTimeout(time.Second).Should(Equal(0.0), "the pool dropped its slots")
	g.Eventually(func() int64 { return liveLeases(t, rdb, gd) }).WithTimeout(2*time.Second).Should(BeZero(),
		"the pool's slots are still held in Redis; the lease TTL is 30s")
}
