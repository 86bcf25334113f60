package sim

import "time"

// autoscaler is the worker fleet under KEDA and the HPA: every polling
// interval it reads the queue depth, wants ceil(depth/target) pods within
// the bounds, scales up by at most max(100%, 4 pods) per poll (the HPA's
// default policy), and scales down only to the largest recommendation of the
// cooldown window (the HPA's stabilisation). New pods take jobs after the
// startup delay.
type autoscaler struct {
	w        Workers
	ready    int
	starting []time.Duration
	history  []recommendation
	pinned   int
	peak     int
}

type recommendation struct {
	at      time.Duration
	desired int
}

func newAutoscaler(w Workers) autoscaler {
	return autoscaler{w: w, ready: w.MinReplicas, peak: w.MinReplicas}
}

// slots is the number of jobs the ready pods run at once.
func (a *autoscaler) slots() int64 { return int64(a.ready) * int64(a.w.SlotsPerPod) }

// nextReady is when the next starting pod becomes ready, or never.
func (a *autoscaler) nextReady() time.Duration {
	if len(a.starting) == 0 {
		return never
	}
	return a.starting[0]
}

func (a *autoscaler) podReady() {
	a.starting = a.starting[1:]
	a.ready++
}

func (a *autoscaler) current() int { return a.ready + len(a.starting) }

// pinAtOutage remembers the replicas at the start of an outage.
func (a *autoscaler) pinAtOutage() { a.pinned = a.current() }

// poll scales on the queue depth within [lo, hi].
func (a *autoscaler) poll(now time.Duration, depth int64, lo, hi int) {
	target := int64(a.w.TargetQueuePerReplica)
	desired := clamp(int((depth+target-1)/target), lo, hi)
	a.remember(now, desired)
	cur := a.current()
	want := desired
	if desired < cur {
		want = min(a.stabilised(), cur)
	}
	want = clamp(want, lo, hi)
	switch {
	case want > cur:
		want = min(want, max(2*cur, cur+4))
		for range want - cur {
			a.starting = append(a.starting, now+a.w.StartupDelay.Duration)
		}
	case want < cur:
		a.remove(cur - want)
	}
	a.peak = max(a.peak, a.current())
}

// remember keeps the recommendations of the cooldown window.
func (a *autoscaler) remember(now time.Duration, desired int) {
	a.history = append(a.history, recommendation{at: now, desired: desired})
	keep := 0
	for keep < len(a.history) && a.history[keep].at <= now-a.w.Cooldown.Duration {
		keep++
	}
	a.history = a.history[keep:]
}

// stabilised is the largest recommendation in the cooldown window.
func (a *autoscaler) stabilised() int {
	best := 0
	for _, r := range a.history {
		best = max(best, r.desired)
	}
	return best
}

// remove stops n pods, the starting ones first.
func (a *autoscaler) remove(n int) {
	drop := min(n, len(a.starting))
	a.starting = a.starting[:len(a.starting)-drop]
	a.ready -= n - drop
}

func clamp(v, lo, hi int) int { return max(lo, min(v, hi)) }
