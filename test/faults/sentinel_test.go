package faults

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/retry"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// recoverAfterFailover bounds how soon after the sentinels elect a new
// master the fleet is back at its limit: releases the old master answered
// and had not replicated keep their slots until their leases expire.
const recoverAfterFailover = leaseTTL + 10*time.Second

// TestFaultSoakSentinel is the soak's Sentinel failover, a fleet of its own:
// Go per-call, Go batch and Python workers find the master through the
// sentinels (no proxy can stand in between), and calls last 4 to 8 s so
// that they outlive the switch. Every other round the replica lags (stopped
// before the kill, a 32 MiB write queued ahead of the leases, and the fleet
// idle until then) so that the failover loses every lease taken since. It runs for a sixth of $SOAK, at least one round
// of each kind. The policy is published by the test (no manager: the state
// is replicated before the first kill, and nothing else needs one).
func TestFaultSoakSentinel(t *testing.T) {
	spec := os.Getenv("SOAK")
	if spec == "" {
		t.Skip("set SOAK to a duration (make soak SOAK=1h)")
	}
	d, err := time.ParseDuration(spec)
	if err != nil {
		t.Fatalf("SOAK=%q: %v", spec, err)
	}
	requirePython(t)
	f := startFleet(t, false, true)
	ctx := t.Context()
	f.ns = "faults"
	f.proto, err = protocol.NewClient(f.rdb, protocol.Dependency{Namespace: f.ns, Name: policyName})
	if err != nil {
		t.Fatal(err)
	}
	_, err = f.proto.Publish(ctx, protocol.Published{State: wire.Closed, Limit: limit, Capacity: limit, Epoch: 1,
		Backoff:       retry.Backoff{Base: 20 * time.Millisecond, Max: 200 * time.Millisecond, Jitter: retry.JitterFull},
		Budget:        retry.Budget{Ratio: 0.2, MinRetries: 10, Window: time.Minute},
		BreakerWindow: 5 * time.Second, HalfOpenProbes: halfOpenProbes})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := f.rdb.Wait(ctx, 1, 5000).Result(); err != nil || n != 1 {
		t.Fatalf("the replica did not receive the policy: %d, %v", n, err)
	}
	f.dep.setHold(4*time.Second, 8*time.Second)
	f.dep.visibility = 30 * time.Second
	for _, k := range []workerKind{goPerCall, goBatch, python} {
		f.startWorker(k)
	}
	c := &campaign{t: t, f: f, injected: map[string]int{}}
	start := time.Now()
	for round := 0; round < 2 || time.Since(start) < d/6; round++ {
		c.failover(ctx, round%2 == 1)
	}
	c.report(time.Since(start))
}

// failover kills the master (after stopping the replica, when lag) and
// checks the cap, the recovery and the jobs; the old master then comes back
// as a replica of the new one.
func (c *campaign) failover(ctx context.Context, lag bool) {
	f, s := c.f, c.f.sentinel
	name := "sentinel-failover"
	label := name
	if lag {
		label += "/lagging-replica"
	}
	f.dep.watch()
	if !waitFor(60*time.Second, func() bool { return !f.dep.reached().IsZero() }) {
		c.breach(name, fmt.Sprintf("before %s: the fleet did not reach its limit within 60s", label))
	}
	f.dep.begin(label)
	c.logf("Injecting %s", label)
	master, err := s.MasterAddr(ctx)
	if err != nil {
		c.t.Fatal(err)
	}
	var replica interface{ Resume() error }
	if lag {
		// The worst case: the fleet is idle when the replica stops, so
		// every lease it then takes is one the replica never receives.
		f.dep.setDraining(true)
		waitFor(f.dep.visibility+30*time.Second, func() bool {
			n, _, _ := f.dep.now()
			return n == 0 && f.dep.pending() == 0
		})
		for _, n := range s.Servers() {
			if n.Addr() != master {
				if err := n.Pause(); err != nil {
					c.t.Fatal(err)
				}
				replica = n
			}
		}
		if err := f.rdb.Set(ctx, "filler", strings.Repeat("x", 32<<20), 0).Err(); err != nil {
			c.t.Fatal(err)
		}
		f.dep.setDraining(false)
		// Leases granted now never reach the replica.
		waitFor(10*time.Second, func() bool { n, _, _ := f.dep.now(); return n >= limit })
	}
	old, err := s.KillMaster(ctx)
	if err != nil {
		c.t.Fatal(err)
	}
	if replica != nil {
		_ = replica.Resume()
	}
	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	_, err = s.WaitFailover(wctx, old.Addr())
	cancel()
	if err != nil {
		c.t.Fatalf("no failover: %v", err)
	}
	elected := time.Now()
	c.mu.Lock()
	c.injected[label]++
	c.mu.Unlock()

	f.dep.watch()
	var recovery time.Duration
	if waitFor(recoverAfterFailover, func() bool { return !f.dep.reached().IsZero() }) {
		recovery = f.dep.reached().Sub(elected)
	} else {
		recovery = time.Since(elected)
		c.breach(name, fmt.Sprintf("%s: the fleet was not back at its limit %d within %v of the election", label, limit, recoverAfterFailover))
	}
	// The old master comes back, empty; the sentinels make it a replica.
	if err := old.Restart(); err != nil {
		c.t.Fatal(err)
	}
	if !waitFor(60*time.Second, func() bool {
		info, err := old.Client(func(o *redis.Options) { o.MaxRetries = -1 }).Info(ctx, "replication").Result()
		return err == nil && strings.Contains(info, "role:slave") && strings.Contains(info, "master_link_status:up")
	}) {
		c.t.Fatalf("the old master %s did not become a synchronised replica within 60s", old.Addr())
	}
	// Every sentinel must see it as a healthy replica before the next
	// round, and a sentinel starts no failover of the same master within
	// twice its failover-timeout of the last one.
	if !waitFor(60*time.Second, func() bool { return sentinelsSeeReplica(ctx, s.SentinelAddrs(), old.Addr()) }) {
		c.t.Fatalf("the sentinels do not list %s as a healthy replica within 60s", old.Addr())
	}
	time.Sleep(time.Until(elected.Add(2*redistest.SentinelFailoverTimeout + time.Second)))
	f.dep.setDraining(true)
	if !waitFor(f.dep.visibility+30*time.Second, func() bool { return f.dep.pending() == 0 }) {
		c.breach(name, fmt.Sprintf("%s: %d jobs handed out and not done", label, f.dep.pending()))
	}
	f.dep.setDraining(false)
	got := f.dep.snapshot()
	if got.peak > limit {
		c.breach(name, fmt.Sprintf("%s: %d calls in flight at the dependency against a limit of %d (%v over the cap)",
			label, got.peak, limit, got.over.Round(time.Millisecond)))
	}
	c.mu.Lock()
	c.peak = max(c.peak, got.peak)
	c.over += got.over
	if recovery > c.slowest {
		c.slowest, c.slowestBy = recovery, label
	}
	c.mu.Unlock()
	c.logf("Fault %s: back at the limit %v after the election (bound %v); peak %d in flight (limit %d), %v over the cap, %d calls",
		label, recovery.Round(10*time.Millisecond), recoverAfterFailover, got.peak, limit, got.over.Round(time.Millisecond), got.calls)
}

// sentinelsSeeReplica reports whether every sentinel lists addr as a replica
// with its link to the master up and no down flag.
func sentinelsSeeReplica(ctx context.Context, sentinels []string, addr string) bool {
	for _, a := range sentinels {
		sc := redis.NewSentinelClient(&redis.Options{Addr: a, MaxRetries: -1})
		replicas, err := sc.Replicas(ctx, redistest.SentinelMasterName).Result()
		sc.Close()
		if err != nil {
			return false
		}
		found := false
		for _, r := range replicas {
			if r["ip"]+":"+r["port"] == addr && r["master-link-status"] == "ok" && !strings.Contains(r["flags"], "down") &&
				!strings.Contains(r["flags"], "disconnected") {
				found = true
			}
		}
		if !found {
			return false
		}
	}
	return true
}
