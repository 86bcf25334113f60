package guard

import (
	"testing"
	"time"
)

func TestRedisClockKeepsTheSmallestRecentOffset(t *testing.T) {
	c := newRedisClock()
	at := func(sent time.Duration, offset time.Duration) time.Time { return time.Unix(0, int64(sent+offset)) }
	want := func(sent, offset time.Duration) {
		t.Helper()
		got := c.deadline(sent, 50*time.Millisecond)
		if w := at(sent, offset+50*time.Millisecond+deadlineSlack); !got.Equal(w) {
			t.Fatalf("deadline at %v: got offset %v, want %v", sent, got.Sub(at(sent, 50*time.Millisecond+deadlineSlack)), offset)
		}
	}
	if d := c.deadline(time.Second, time.Second); !d.IsZero() {
		t.Fatalf("deadline before any reply: %v, want none", d)
	}
	const base = 1000 * time.Hour // Redis's clock far ahead of the local one
	c.observe(1*time.Second, at(1*time.Second, base+10*time.Millisecond))
	c.observe(2*time.Second, at(2*time.Second, base+3*time.Millisecond))
	c.observe(3*time.Second, at(3*time.Second, base+8*time.Millisecond))
	want(4*time.Second, base+3*time.Millisecond)

	// The smallest sample outlives the period it was taken in by one period.
	c.observe(1*time.Second+offsetPeriod, at(1*time.Second+offsetPeriod, base+7*time.Millisecond))
	want(2*time.Second+offsetPeriod, base+3*time.Millisecond)
	c.observe(1*time.Second+2*offsetPeriod, at(1*time.Second+2*offsetPeriod, base+9*time.Millisecond))
	want(2*time.Second+2*offsetPeriod, base+7*time.Millisecond)

	// A late refusal that came in time: Redis's clock jumped ahead.
	sent := 3 * offsetPeriod
	c.reset(sent, at(sent, base+time.Minute))
	want(sent+time.Second, base+time.Minute)
	// Replies without a time (no policy) leave the estimate alone.
	c.observe(sent+2*time.Second, time.Time{})
	want(sent+time.Second, base+time.Minute)
}
