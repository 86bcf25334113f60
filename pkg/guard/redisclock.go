package guard

import (
	"sync"
	"time"
)

// offsetPeriod is how long a minimum offset sample is trusted before newer
// samples replace it: long enough that one fast round trip in each period
// keeps the estimate tight, short enough that a slow drift or a failover to
// a master whose clock is behind is followed within a minute.
const offsetPeriod = 30 * time.Second

// deadlineSlack covers the millisecond rounding of Redis's time in replies
// and of the deadline in requests.
const deadlineSlack = 2 * time.Millisecond

// redisClock estimates Redis's time from the guard's monotonic clock, so that
// each acquisition can carry the Redis time after which its caller no longer
// waits for the reply (protocol.AcquireArgs.Deadline).
//
// Each reply gives a sample: Redis's time when the script ran minus the local
// monotonic time when the request was sent. The script ran after the send,
// so every sample is at least the true offset; the smallest recent sample is
// the closest. A deadline built from it is never earlier than the true one:
// a request that ran in time is never refused as late, unless Redis's clock
// moved (a failover to a master with another clock), and Acquire resets the
// estimate then.
type redisClock struct {
	base time.Time // local reference carrying a monotonic reading

	mu        sync.Mutex
	known     bool
	cur, prev time.Duration // smallest sample in this period and the last; prev valid when hasPrev
	hasPrev   bool
	curStart  time.Duration // local time the current period started
}

func newRedisClock() *redisClock { return &redisClock{base: time.Now()} }

// now is the local monotonic time, immune to wall-clock steps.
func (c *redisClock) now() time.Duration { return time.Since(c.base) }

// sample is the offset one reply shows: Redis time minus local send time.
func sample(sent time.Duration, redisNow time.Time) time.Duration {
	return time.Duration(redisNow.UnixNano()) - sent
}

// observe records the reply to a request sent at sent (local time).
func (c *redisClock) observe(sent time.Duration, redisNow time.Time) {
	if redisNow.IsZero() {
		return
	}
	s := sample(sent, redisNow)
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case !c.known:
		c.known, c.cur, c.hasPrev, c.curStart = true, s, false, sent
	case sent-c.curStart >= offsetPeriod:
		c.prev, c.hasPrev = c.cur, true
		c.cur, c.curStart = s, sent
	default:
		c.cur = min(c.cur, s)
	}
}

// reset forgets every sample but this one: a reply that arrived in time was
// refused as late, so Redis's clock is ahead of what the samples say.
func (c *redisClock) reset(sent time.Duration, redisNow time.Time) {
	c.mu.Lock()
	c.known = false
	c.mu.Unlock()
	c.observe(sent, redisNow)
}

// deadline is the Redis time by which a request sent at sent (local time)
// must run for its reply to be read within wait; zero, meaning no deadline,
// before the first reply.
func (c *redisClock) deadline(sent, wait time.Duration) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.known {
		return time.Time{}
	}
	off := c.cur
	if c.hasPrev {
		off = min(off, c.prev)
	}
	return time.Unix(0, int64(off+sent+wait+deadlineSlack))
}
