package sim

import (
	"time"

	"github.com/spillway-dev/spillway/pkg/protocol"
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

// budgetWindow returns the calls released (completed) and the retries
// granted in the current second and the window-1 seconds before it, as
// budget.lua counts them.
func (c *counters) budgetWindow(now, window time.Duration) (calls, retries int64) {
	from := max(0, int(now/time.Second)-int(window/time.Second)+1)
	return c.ok + c.failed - c.cumOK[from] - c.cumFailed[from], c.retries - c.cumRetries[from]
}

// window returns the outcomes counted in the seconds (from_s, now_s], where
// now_s is the second holding now and from_s the later of now_s - length and
// the second holding from: what window.lua reads for the evaluator.
func (c *counters) window(now time.Time, length time.Duration, from time.Time) protocol.Window {
	nowS := second(now)
	fromS := max(nowS-int(length/time.Second), second(from))
	if fromS >= nowS {
		return protocol.Window{}
	}
	k := max(fromS+1, 0)
	ok, failed := c.ok-c.cumOK[k], c.failed-c.cumFailed[k]
	return protocol.Window{Calls: ok + failed, Successes: ok, Failures: failed}
}
