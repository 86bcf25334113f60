package sim

import (
	"time"

	"github.com/spillway-dev/spillway/internal/breaker"
)

// counters count calls, outcomes and granted retries, with the totals at the
// start of every second, so that any window of whole seconds is a
// subtraction, as workers count in one-second buckets.
type counters struct {
	calls, ok, failed, retries             int64
	cumCalls, cumOK, cumFailed, cumRetries []int64
	startsThisSecond                       int64
}

func newCounters(seconds int) counters {
	return counters{
		cumCalls:   make([]int64, seconds),
		cumOK:      make([]int64, seconds),
		cumFailed:  make([]int64, seconds),
		cumRetries: make([]int64, seconds),
	}
}

func (c *counters) startCall() {
	c.calls++
	c.startsThisSecond++
}

func (c *counters) outcome(ok bool) {
	if ok {
		c.ok++
	} else {
		c.failed++
	}
}

func (c *counters) retryGranted() { c.retries++ }

// closeSecond records the totals at the start of second k and returns the
// calls started in second k-1.
func (c *counters) closeSecond(k int) int64 {
	c.cumCalls[k], c.cumOK[k], c.cumFailed[k], c.cumRetries[k] = c.calls, c.ok, c.failed, c.retries
	starts := c.startsThisSecond
	c.startsThisSecond = 0
	return starts
}

// budgetWindow returns the calls started and the retries granted in the
// current second and the window-1 seconds before it.
func (c *counters) budgetWindow(now, window time.Duration) (calls, retries int64) {
	from := max(0, int(now/time.Second)-int(window/time.Second)+1)
	return c.calls - c.cumCalls[from], c.retries - c.cumRetries[from]
}

// outcomesSince returns the calls completed, and the failures among them,
// from the start of second sec until now. It is called at a tick, so every
// completion counted is in a whole closed second.
func (c *counters) outcomesSince(sec int) breaker.Counts {
	sec = max(sec, 0)
	ok, failed := c.ok-c.cumOK[sec], c.failed-c.cumFailed[sec]
	return breaker.Counts{Calls: ok + failed, Failures: failed}
}
