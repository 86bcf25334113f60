package guard

import (
	"testing"
	"time"

	"github.com/spillway-dev/spillway/pkg/protocol"
)

// localTokens reads a reply's token windows against both ends of the round
// trip, so that a token is used only when Redis's clock is surely inside
// its window: it opens no earlier than the reply arrived plus the time to
// the window's start, and dies no later than the request was sent plus the
// time to its due (less Redis's millisecond truncation).
func TestLocalTokensAreInsideTheirWindowsWhateverTheRoundTrip(t *testing.T) {
	base := time.Unix(1_000, 0)
	for _, c := range []struct {
		name       string
		sent, recv time.Duration // local times, from base
	}{
		{"instant round trip", 0, 0},
		{"5 ms round trip", 0, 5 * time.Millisecond},
		{"60 ms round trip", 0, 60 * time.Millisecond},
	} {
		t.Run(c.name, func(t *testing.T) {
			now := base.Add(2 * time.Millisecond) // Redis's time when the script ran
			rt := protocol.RateTokens{Count: 10, First: now.Add(45 * time.Millisecond), Interval: 5 * time.Millisecond, Spread: 95 * time.Millisecond}
			b := localTokens(rt, now, base.Add(c.sent), base.Add(c.recv))
			for j := range rt.Count {
				from, until := rt.Window(j)
				open := b.open.Add(time.Duration(j) * b.interval)
				due := b.due.Add(time.Duration(j) * b.interval)
				// Redis ran between sent and recv: at local time x its clock
				// reads at least now + (x − recv), at most now + 1ms + (x − sent).
				if earliest := now.Add(open.Sub(base.Add(c.recv))); earliest.Before(from) {
					t.Errorf("token %d opens locally at Redis time %v at the earliest, before its window %v", j, earliest.Sub(base), from.Sub(base))
				}
				if latest := now.Add(time.Millisecond + due.Sub(base.Add(c.sent))); latest.After(until) {
					t.Errorf("token %d dies locally at Redis time %v at the latest, after its due %v", j, latest.Sub(base), until.Sub(base))
				}
			}
		})
	}
}

// A token stock spends tokens in order, never before a window opens, skips
// the tokens that died unspent (they cannot be saved for a burst), and moves
// to the next batch once one is spent.
func TestTokenStockSpendsOnlyLiveTokens(t *testing.T) {
	t0 := time.Unix(2_000, 0)
	ms := func(n int) time.Time { return t0.Add(time.Duration(n) * time.Millisecond) }
	stock := func() *tokenStock {
		s := &tokenStock{limited: true}
		// Three tokens, 10 ms apart: token j opens at 10j ms and dies at
		// 50 + 10j ms; then two more, opening at 100 and 110 ms.
		s.add(tokenBatch{count: 3, open: ms(0), due: ms(50), interval: 10 * time.Millisecond})
		s.add(tokenBatch{count: 2, open: ms(100), due: ms(150), interval: 10 * time.Millisecond})
		return s
	}
	for _, c := range []struct {
		name  string
		takes []int // local times, ms
		want  []bool
		live  int64 // live tokens after the takes, at the last take's time
	}{
		{"in order", []int{0, 10, 20}, []bool{true, true, true}, 2},
		{"not before its window", []int{0, 5}, []bool{true, false}, 4},
		{"dead tokens skipped", []int{65}, []bool{true}, 2}, // tokens 0 and 1 died at 50 and 60 ms
		{"a batch spent, the next not open yet", []int{0, 10, 20, 30}, []bool{true, true, true, false}, 2},
		{"the next batch", []int{0, 10, 20, 100, 105, 110}, []bool{true, true, true, true, false, true}, 0},
		{"all dead", []int{200}, []bool{false}, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := stock()
			for i, at := range c.takes {
				if got := s.take(ms(at)); got != c.want[i] {
					t.Errorf("take at %d ms = %v, want %v", at, got, c.want[i])
				}
			}
			if got := s.live(ms(c.takes[len(c.takes)-1])); got != c.live {
				t.Errorf("live = %d, want %d", got, c.live)
			}
		})
	}
}

// A pool asks for the most slots its process used at once in the last
// demandIntervals refreshes, and for the rate tokens it spent or was
// refused in the busiest of them; it is idle once none is remembered.
func TestDemandRemembersTheBusiestRecentInterval(t *testing.T) {
	var d demand
	if !d.idle() {
		t.Fatal("a new demand is not idle")
	}
	steps := []struct {
		observe     []int64 // running + waiting, observed during the interval
		refused     int     // calls refused for want of a slot
		starts      int     // calls started on a rate token
		active      int64   // running + waiting when the interval closes
		slots, toks int64   // what roll asks for
	}{
		{observe: []int64{3, 8, 5}, refused: 2, starts: 4, active: 5, slots: 10, toks: 4},
		// The calls active when an interval closes count in the next one.
		{observe: []int64{4}, active: 1, slots: 10, toks: 4},
		{active: 0, slots: 10, toks: 4},
		{active: 0, slots: 5, toks: 0}, // the busiest interval is forgotten
		{active: 0, slots: 1, toks: 0},
	}
	for i, s := range steps {
		d.touch()
		for _, a := range s.observe {
			d.observe(a)
		}
		for range s.refused {
			d.refuse(false)
		}
		for range s.starts {
			d.start()
		}
		slots, toks := d.roll(s.active)
		if slots != s.slots || toks != s.toks {
			t.Errorf("step %d: roll = %d slots, %d tokens; want %d, %d", i, slots, toks, s.slots, s.toks)
		}
	}
	for range demandIntervals {
		d.roll(0)
	}
	if !d.idle() {
		t.Error("no demand for demandIntervals intervals, and not idle")
	}
}
