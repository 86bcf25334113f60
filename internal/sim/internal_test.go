package sim

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

func TestDelayQueueOrder(t *testing.T) {
	tests := []struct {
		name   string
		timers int
		within time.Duration
	}{
		{"spread over 90 s", 2000, 90 * time.Second},
		{"several blocks a second", 5 * timerBlockLen, 2 * time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := newDelayQueue(100)
			rnd := rand.New(rand.NewPCG(1, 2))
			var want []time.Duration
			for i := range tt.timers {
				at := time.Second + time.Duration(rnd.Int64N(int64(tt.within)))
				d.add(at, int32(i), false)
				want = append(want, at)
			}
			d.add(200*time.Second, 9999, false) // past the last bucket: never fires
			slices.Sort(want)
			var got []time.Duration
			for sec := 0; sec < 100; sec++ {
				d.startSecond(sec)
				for d.next() != never {
					got = append(got, d.next())
					d.pop()
				}
			}
			if !slices.Equal(got, want) {
				t.Fatalf("popped %d timers out of order, want %d", len(got), len(want))
			}
			if d.len() != 1 {
				t.Errorf("len = %d, want 1 (the timer past the horizon)", d.len())
			}
		})
	}
}

func TestDelayQueueAddInCurrentSecond(t *testing.T) {
	d := newDelayQueue(10)
	d.startSecond(3)
	d.add(3500*time.Millisecond, 1, false)
	d.add(3200*time.Millisecond, 2, true)
	d.add(4100*time.Millisecond, 3, false)
	if got := d.pop(); got.job != 2 || !got.parking {
		t.Fatalf("first pop = %+v, want job 2, parking", got)
	}
	if got := d.pop(); got.job != 1 {
		t.Fatalf("second pop = %+v, want job 1", got)
	}
	if d.next() != never {
		t.Fatalf("timer of second 4 visible during second 3")
	}
	d.startSecond(4)
	if got := d.pop(); got.job != 3 {
		t.Fatalf("third pop = %+v, want job 3", got)
	}
}

// TestDelayQueueMixesBucketAndCurrentSecond pops, in time order and then by
// job, timers that were in the second's bucket and timers added while it
// was current, equal times included.
func TestDelayQueueMixesBucketAndCurrentSecond(t *testing.T) {
	d := newDelayQueue(10)
	at := func(ms int) time.Duration { return time.Duration(ms) * time.Millisecond }
	for _, tm := range []timer{{at(2900), 7, false}, {at(2100), 9, false}, {at(2500), 4, false}, {at(2500), 2, true}} {
		d.add(tm.at, tm.job, tm.parking)
	}
	d.startSecond(2)
	d.add(at(2500), 3, false) // between bucket timers of the same time
	d.add(at(2050), 8, false) // before every bucket timer
	d.add(at(2950), 1, false) // after them all
	want := []timer{{at(2050), 8, false}, {at(2100), 9, false}, {at(2500), 2, true}, {at(2500), 3, false}, {at(2500), 4, false}, {at(2900), 7, false}, {at(2950), 1, false}}
	for i, w := range want {
		if d.next() != w.at {
			t.Fatalf("pop %d: next = %v, want %v", i, d.next(), w.at)
		}
		if got := d.pop(); got != w {
			t.Fatalf("pop %d = %+v, want %+v", i, got, w)
		}
	}
	if d.next() != never || d.len() != 0 {
		t.Fatalf("after all pops: next %v, len %d", d.next(), d.len())
	}
}

func TestJobTable(t *testing.T) {
	tests := []struct {
		name            string
		deadlines, keys bool
		wantDeadline    time.Duration
		wantKey         int32
	}{
		{"no deadline, no key", false, false, 0, -1},
		{"deadline", true, false, 5 * time.Second, -1},
		{"key", false, true, 0, 7},
		{"both", true, true, 5 * time.Second, 7},
		{"a deadline above 32 bits", true, false, 23 * time.Hour, -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var jt jobTable
			jt.reset(100, tt.deadlines, tt.keys)
			for round := range 2 {
				for range 130 { // past the room made, and past two bitset words
					id := jt.add(max(tt.wantDeadline, 5*time.Second), 7)
					if jt.parked.has(id) || jt.ended.has(id) || jt.attempts[id] != 0 {
						t.Fatalf("round %d: job %d starts parked %v, ended %v, %d attempts", round, id, jt.parked.has(id), jt.ended.has(id), jt.attempts[id])
					}
					if d, k := jt.deadlineOf(id), jt.keyOf(id); d != tt.wantDeadline || k != tt.wantKey {
						t.Fatalf("job %d: deadline %v, key %d; want %v, %d", id, d, k, tt.wantDeadline, tt.wantKey)
					}
					jt.parked.set(id)
					jt.ended.set(id)
					for range 70000 {
						jt.attempt(id)
					}
				}
				if jt.len() != 130 || jt.attempts[129] != maxAttempts {
					t.Fatalf("len %d, attempts %d; want 130, %d (saturated)", jt.len(), jt.attempts[129], maxAttempts)
				}
				// A reused table starts empty, with every bit clear.
				jt.reset(100, tt.deadlines, tt.keys)
			}
		})
	}
}

func TestFIFO(t *testing.T) {
	tests := []struct {
		name        string
		pushes, pop int // push pushes ids, pop one every pop pushes (0: never)
		drain       bool
	}{
		{"within a block", 100, 3, false},
		{"across blocks", 3 * fifoBlockLen, 3, false},
		{"a block boundary exactly", 2 * fifoBlockLen, 0, true},
		{"drained and refilled", 2*fifoBlockLen + 7, 2, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var q fifo
			var want []int32
			seen := map[*fifoBlock]bool{}
			for round := range 2 {
				for i := range int32(tt.pushes) {
					id := int32(round)*1e6 + i
					q.push(id)
					want = append(want, id)
					if tt.pop > 0 && int(i)%tt.pop == 0 {
						if got := q.pop(); got != want[0] {
							t.Fatalf("pop = %d, want %d", got, want[0])
						}
						want = want[1:]
					}
				}
				if q.len() != len(want) || q.peek() != want[0] {
					t.Fatalf("len %d, head %d; want %d, %d", q.len(), q.peek(), len(want), want[0])
				}
				// A drained queue refilled as much reuses its blocks.
				for _, b := range q.blocks {
					if round == 0 {
						seen[b] = true
					} else if tt.drain && !seen[b] {
						t.Fatalf("round 2 holds a new block: the drained ones were not reused")
					}
				}
				if !tt.drain {
					continue
				}
				for len(want) > 0 {
					if got := q.pop(); got != want[0] {
						t.Fatalf("drain: pop = %d, want %d", got, want[0])
					}
					want = want[1:]
				}
				if q.len() != 0 {
					t.Fatalf("drained len = %d", q.len())
				}
			}
		})
	}
}

// TestFIFOEmptiedAtEveryJobDoesNotAllocate: a drained queue takes each job
// as it arrives; that must not cost an allocation per job.
func TestFIFOEmptiedAtEveryJobDoesNotAllocate(t *testing.T) {
	var q fifo
	q.push(0)
	q.pop()
	if n := testing.AllocsPerRun(10_000, func() {
		q.push(1)
		q.pop()
	}); n != 0 {
		t.Errorf("%v allocations a job, want 0", n)
	}
}

func TestAutoscaler(t *testing.T) {
	w := Workers{SlotsPerPod: 2, MinReplicas: 10, MaxReplicas: 80, TargetQueuePerReplica: 100}
	w.StartupDelay.Duration = 30 * time.Second
	w.Cooldown.Duration = 5 * time.Minute
	a := newAutoscaler(w)
	steps := []struct {
		at            time.Duration
		depth         int64
		wantReplicas  int
		wantReadyPods int
	}{
		{15 * time.Second, 50_000, 20, 10}, // at most double per poll
		{30 * time.Second, 50_000, 40, 10}, // pods still starting
		{45 * time.Second, 50_000, 80, 10}, // capped at max
		{2 * time.Minute, 0, 80, 10},       // cooldown holds the fleet
		{7 * time.Minute, 0, 10, 10},       // back to min after 5 minutes
	}
	for _, s := range steps {
		a.poll(s.at, s.depth, w.MinReplicas, w.MaxReplicas)
		if a.current() != s.wantReplicas {
			t.Fatalf("at %v: %d replicas, want %d", s.at, a.current(), s.wantReplicas)
		}
	}
	if a.peak != 80 {
		t.Errorf("peak = %d, want 80", a.peak)
	}
	a.poll(8*time.Minute, 1200, 10, 80)
	if a.nextReady() != 8*time.Minute+30*time.Second {
		t.Errorf("new pods ready at %v, want after the startup delay", a.nextReady())
	}
	a.podReady()
	if a.slots() != 22 {
		t.Errorf("slots = %d, want 22", a.slots())
	}
}

func TestDependencyColdStartAndCollapse(t *testing.T) {
	sc := &Scenario{Dependency: Dependency{Concurrency: 40, ColdStart: ColdStart{Factor: 0.6}}}
	sc.Dependency.ColdStart.Duration.Duration = 2 * time.Minute
	sc.Dependency.Collapse.After.Duration = 3 * time.Second
	sc.Dependency.CallDuration.Duration = 100 * time.Millisecond
	d := newDependency(sc)
	if got := d.effective(0); got != 40 {
		t.Fatalf("warm capacity = %d, want 40", got)
	}
	d.goDown(10*time.Second, 20*time.Second)
	if d.accept(11*time.Second) || !d.upSince(11*time.Second) {
		t.Fatalf("accepted a call while down")
	}
	d.comeUp(20 * time.Second)
	if got := d.effective(30 * time.Second); got != 24 {
		t.Fatalf("cold capacity = %d, want 24", got)
	}
	// Each second, starts calls of 100 ms arrive in waves of 24 every
	// 100 ms: those beyond the 24 slots are turned away. The work offered
	// is starts × 100 ms against 24 slot-seconds.
	d.overloaded(31 * time.Second)
	for i, starts := range []int64{300, 300, 200, 300, 300, 300} {
		at := time.Duration(31+i) * time.Second
		for wave := range 10 {
			now := at + time.Duration(wave)*d.callDur
			var served int64
			for range starts / 10 {
				if d.accept(now) {
					served++
				}
			}
			for range served {
				d.release(now + d.callDur)
			}
		}
		collapsed := d.overloaded(at + time.Second)
		if collapsed != (i == 5) {
			t.Fatalf("second %d (%d calls offered, 240/s served): collapse %v", i, starts, collapsed)
		}
	}
	if got := d.effective(20*time.Second + 2*time.Minute); got != 40 {
		t.Errorf("capacity after warm-up = %d, want 40", got)
	}
}

// TestControllerLimits walks the control law through an outage and a
// recovery and checks the fleet limit the controller publishes: capacity, 0
// while Open, the probes while HalfOpen, then the ramp's steps.
func TestControllerLimits(t *testing.T) {
	sc, err := Builtin("email-outage")
	if err != nil {
		t.Fatal(err)
	}
	params, err := policy.FromSpec(sc.Policy.Spec)
	if err != nil {
		t.Fatal(err)
	}
	clk := &virtualClock{}
	cnt := newCounters(1000)
	c := newController(params, clk.Now(), 0)
	var limits []int64
	// step reports ok and failed calls, each started under the published
	// state (a probe while HalfOpen), then evaluates a second later.
	step := func(ok, failed int64) {
		for i := range int32(ok + failed) {
			probe := c.started(i)
			cnt.outcome(int64(i) < ok)
			c.released(i, probe, int64(i) < ok)
		}
		clk.now += time.Second
		cnt.closeSecond(int(clk.now / time.Second))
		c.evaluate(&cnt, clk.Now())
		if l := c.limit(); len(limits) == 0 || limits[len(limits)-1] != l {
			limits = append(limits, l)
		}
	}
	step(50, 0)    // healthy: full capacity
	step(0, 50)    // outage: opens
	for range 60 { // open for openDuration, then half open
		step(0, 0)
	}
	step(3, 0)      // probes succeed: closes, ramp from 5
	for range 200 { // clean minutes climb the ramp
		step(50, 0)
	}
	want := []int64{40, 0, 3, 5, 10, 20, 40}
	if !slices.Equal(limits, want) {
		t.Fatalf("limits = %v, want %v", limits, want)
	}
}

// TestControllerProbes: HalfOpen admits the limit's probes per epoch in all,
// whatever is in flight; only the current HalfOpen epoch's probes count, and
// a new epoch starts afresh (acquire.lua, release.lua, publish.lua).
func TestControllerProbes(t *testing.T) {
	sc, err := Builtin("email-outage")
	if err != nil {
		t.Fatal(err)
	}
	params, err := policy.FromSpec(sc.Policy.Spec)
	if err != nil {
		t.Fatal(err)
	}
	open := params.Breaker.OpenDuration
	clk := &virtualClock{}
	cnt := newCounters(1000)
	c := newController(params, clk.Now(), 0)
	tick := func(d time.Duration) {
		for range int(d / time.Second) {
			clk.now += time.Second
			cnt.closeSecond(int(clk.now / time.Second))
			c.evaluate(&cnt, clk.Now())
		}
	}
	if !c.allows(params.Capacity-1) || c.allows(params.Capacity) {
		t.Fatalf("Closed: calls in flight must stay under the capacity %d", params.Capacity)
	}
	if c.started(1) {
		t.Fatalf("a call started Closed is not a probe")
	}
	for range 50 {
		cnt.outcome(false)
	}
	tick(time.Second)
	if c.pub.State != wire.Open || c.allows(0) {
		t.Fatalf("state %s, allows %v: want Open, admitting nothing", c.pub.State, c.allows(0))
	}
	tick(open)
	if c.pub.State != wire.HalfOpen {
		t.Fatalf("state %s after openDuration, want HalfOpen", c.pub.State)
	}
	epoch := c.pub.Epoch
	var probes []int32
	for job := int32(10); c.allows(1000) && job < 20; job++ {
		if !c.started(job) {
			t.Fatalf("a call started HalfOpen is a probe")
		}
		probes = append(probes, job)
	}
	if int64(len(probes)) != params.Breaker.HalfOpenProbes {
		t.Fatalf("HalfOpen admitted %d probes, want %d in all", len(probes), params.Breaker.HalfOpenProbes)
	}
	// A call started before HalfOpen ending now is no probe; two probes
	// succeed.
	c.released(1, false, true)
	c.released(probes[0], true, true)
	c.released(probes[1], true, true)
	if c.probes != (protocol.Probes{Successes: 2}) {
		t.Fatalf("probes = %+v, want the two of this epoch", c.probes)
	}
	tick(time.Second)
	if c.pub.State != wire.HalfOpen || c.pub.Epoch != epoch {
		t.Fatalf("two of three probes: state %s epoch %d, want HalfOpen %d", c.pub.State, c.pub.Epoch, epoch)
	}
	// The third fails: Open again, and its epoch's counts are gone.
	c.released(probes[2], true, false)
	tick(time.Second)
	if c.pub.State != wire.Open || c.probes != (protocol.Probes{}) || c.admitted != 0 {
		t.Fatalf("after a failed probe: state %s probes %+v admitted %d, want Open and a fresh epoch", c.pub.State, c.probes, c.admitted)
	}
	// A probe still in flight when its epoch ends does not count in the next
	// HalfOpen epoch.
	tick(open)
	if c.pub.State != wire.HalfOpen || !c.started(40) || !c.started(41) {
		t.Fatalf("state %s: want HalfOpen admitting probes", c.pub.State)
	}
	c.released(41, true, false)
	tick(time.Second)
	tick(open)
	if c.pub.State != wire.HalfOpen {
		t.Fatalf("state %s: want HalfOpen again", c.pub.State)
	}
	c.released(40, true, true)
	if c.probes != (protocol.Probes{}) {
		t.Fatalf("a probe of an earlier epoch counted in epoch %d: probes %+v", c.pub.Epoch, c.probes)
	}
}
