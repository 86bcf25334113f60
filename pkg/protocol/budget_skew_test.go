package protocol_test

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/retry"
)

// oldBudget is the previous version's budget decision, as its client read
// the reply: {allowed, base ms, max ms, jitter, calls, granted[, grants]}.
type oldBudget struct {
	allowed                bool
	calls, granted, grants int64
}

// runOldBudget runs the previous version's budget script, asking for n
// retries at once when n > 0 (its RetryBudgetN), else for one.
func runOldBudget(t *testing.T, budget *redis.Script, rdb redis.UniversalClient, k protocol.Keys, n int64) oldBudget {
	t.Helper()
	var args []any
	if n > 0 {
		args = append(args, n)
	}
	res, err := budget.Run(ctxT(t), rdb, []string{k.State, k.Stats}, args...).Slice()
	if err != nil {
		t.Fatalf("previous version's budget: %v", err)
	}
	if len(res) != 6+len(args) {
		t.Fatalf("previous version's budget replied %v, want %d fields", res, 6+len(args))
	}
	b := oldBudget{allowed: res[0].(int64) == 1, calls: res[4].(int64), granted: res[5].(int64)}
	switch {
	case n > 0:
		b.grants = res[6].(int64)
	case b.allowed:
		b.grants = 1
	}
	return b
}

// TestRetryBudgetSharedAcrossVersions: the previous version's real budget
// script (from the commit its pin names) and this version's draw from one
// budget: a retry either grants is counted by the other, the calls either
// version's workers report raise the bound for both, and once the bound is
// reached both refuse. Together they never grant more than
// max(MinRetries, Ratio × calls), one at a time or n at once.
func TestRetryBudgetSharedAcrossVersions(t *testing.T) {
	t.Parallel()
	oldBudgetScript := previousScripts(t)["budget"]
	old := previousScripts(t)
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		k := c.Keys()
		p := policy(10)
		p.Budget = retry.Budget{Ratio: 0.5, MinRetries: 3, Window: time.Minute}
		mustPublish(t, c, p)

		newOne := func() protocol.BudgetDecision {
			t.Helper()
			d, err := c.RetryBudget(ctxT(t))
			if err != nil {
				t.Fatalf("version %d budget: %v", protocol.Version, err)
			}
			return d
		}

		// No calls yet: the bound is MinRetries (3), shared. Old, new, old
		// are granted, each seeing the grants of the other version.
		if b := runOldBudget(t, oldBudgetScript, rdb, k, 0); !b.allowed || b.granted != 0 {
			t.Fatalf("previous version's first retry: %+v; want granted, 0 granted before", b)
		}
		if d := newOne(); !d.Allowed || d.Granted != 1 {
			t.Fatalf("version %d's retry after the previous version's grant: %+v; want granted, 1 granted before", protocol.Version, d)
		}
		if b := runOldBudget(t, oldBudgetScript, rdb, k, 0); !b.allowed || b.granted != 2 {
			t.Fatalf("previous version's second retry: %+v; want granted, 2 granted before (one of them by version %d)", b, protocol.Version)
		}
		// The bound is reached: both refuse.
		if d := newOne(); d.Allowed || d.Granted != 3 {
			t.Errorf("version %d's retry past the bound: %+v; want refused, 3 granted before", protocol.Version, d)
		}
		if b := runOldBudget(t, oldBudgetScript, rdb, k, 0); b.allowed || b.granted != 3 {
			t.Errorf("previous version's retry past the bound: %+v; want refused, 3 granted before", b)
		}

		// 6 failed calls reported by each version's release: 12 calls, so
		// the bound is 0.5 × 12 = 6 for both, 3 more retries.
		for range 6 {
			if err := old["release"].Run(ctxT(t), rdb, []string{k.Leases, k.Stats, k.State, k.Probes, k.Calls}, "", "f", 1).Err(); err != nil {
				t.Fatalf("previous version's release: %v", err)
			}
		}
		releaseN(t, c, 6, protocol.Failure)
		d, err := c.RetryBudgetN(ctxT(t), 2)
		if err != nil {
			t.Fatal(err)
		}
		if d.Grants != 2 || d.Calls != 12 || d.Granted != 3 {
			t.Errorf("version %d asks 2 of a bound of 6 with 3 granted: %+v; want 2 granted, 12 calls and 3 granted before", protocol.Version, d)
		}
		if b := runOldBudget(t, oldBudgetScript, rdb, k, 3); b.grants != 1 || b.calls != 12 || b.granted != 5 {
			t.Errorf("previous version asks 3 of a bound of 6 with 5 granted: %+v; want 1 granted, 12 calls and 5 granted before", b)
		}
		if d := newOne(); d.Allowed || d.Granted != 6 || d.Calls != 12 {
			t.Errorf("version %d's retry with the bound spent by both versions: %+v; want refused, 6 granted before of 12 calls", protocol.Version, d)
		}
		if b := runOldBudget(t, oldBudgetScript, rdb, k, 0); b.allowed || b.granted != 6 {
			t.Errorf("previous version's retry with the bound spent by both versions: %+v; want refused, 6 granted before", b)
		}

		// The manager's window counts both versions' decisions: 6 granted
		// (3 by each), and 6 refused: one by each version at the first
		// bound, 2 of the 3 the previous version asked at once, and one by
		// each at the second.
		w, _ := mustWindow(t, c, time.Minute, time.Time{})
		if w.Calls != 12 || w.RetriesGranted != 6 || w.BudgetRefused != 6 {
			t.Errorf("window: %d calls, %d retries granted, %d refused; want 12, 6 and 6", w.Calls, w.RetriesGranted, w.BudgetRefused)
		}
	})
}
