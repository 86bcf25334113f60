package guard

import (
	"context"
	"sync"
	"time"

	"github.com/spillway-dev/spillway/pkg/protocol"
)

const (
	// forgetQueue bounds the leases waiting to be forgotten. A fleet that
	// overflows it (thousands of unread replies within one outage) leaves
	// the overflow to expire with its lease TTL.
	forgetQueue = 8192
	// forgetBackoffMin and forgetBackoffMax space the attempts while Redis
	// does not answer. The maximum bounds how long after Redis answers again
	// the forgetter notices: it is most of the ghost-lease bound.
	forgetBackoffMin = 20 * time.Millisecond
	forgetBackoffMax = 500 * time.Millisecond
	// forgetTimeoutMin bounds one forget round trip from below: forgets are
	// off the call path, so they can wait for a slow Redis longer than an
	// acquisition does.
	forgetTimeoutMin = 250 * time.Millisecond
	// forgetDrain bounds how long Close spends forgetting the leases still
	// queued: one attempt each, a round trip each while Redis answers.
	forgetDrain = time.Second
)

// unread is a lease that may be held in Redis though no call holds it: its
// acquisition's reply, or its release's, was never read.
type unread struct {
	member string
	// expires is the local monotonic time by which the lease has expired in
	// Redis anyway: its last acquire or renew send time plus the lease TTL.
	expires time.Time
}

// forgetter makes unread leases stop counting, in the background: one
// goroutine per Guard, started by the first lease it is handed, that calls
// protocol.Client.Forget for each in turn and retries with a capped backoff
// while Redis does not answer. It gives a lease up once the lease has expired
// by itself. It never blocks a caller: when its queue is full the lease is
// left to expire. Guard.Close stops it, after one attempt for each lease
// still queued, for at most forgetDrain: a worker that shuts down right
// after a Redis blip leaves no slot held for the lease TTL.
type forgetter struct {
	proto   *protocol.Client
	timeout time.Duration
	metrics *metrics

	queue chan unread
	stop  chan struct{}
	done  chan struct{}

	mu      sync.Mutex
	started bool
	closed  bool
	drainBy time.Time // set by close
}

func newForgetter(proto *protocol.Client, redisTimeout time.Duration, m *metrics) *forgetter {
	return &forgetter{
		proto:   proto,
		timeout: max(redisTimeout, forgetTimeoutMin),
		metrics: m,
		queue:   make(chan unread, forgetQueue),
		stop:    make(chan struct{}),
		done:    make(chan struct{}),
	}
}

// add hands over a lease whose reply was not read. It never blocks.
func (f *forgetter) add(u unread) {
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		f.metrics.unread(unreadDropped)
		return
	}
	if !f.started {
		f.started = true
		go f.run()
	}
	f.mu.Unlock()
	select {
	case f.queue <- u:
		f.metrics.unread(unreadQueued)
	default:
		f.metrics.unread(unreadDropped)
	}
}

// close stops the goroutine and waits for it, once it has tried to forget
// each lease still queued (drain); the leases it could not forget expire
// with their TTL.
func (f *forgetter) close() {
	f.mu.Lock()
	started := f.started
	if !f.closed {
		f.closed = true
		f.drainBy = time.Now().Add(forgetDrain)
		close(f.stop)
	}
	f.mu.Unlock()
	if started {
		<-f.done
	}
}

func (f *forgetter) run() {
	defer close(f.done)
	for {
		select {
		case <-f.stop:
			f.drain(nil)
			return
		case u := <-f.queue:
			select {
			case <-f.stop: // closed meanwhile: the drain's bound applies
				f.drain(&u)
				return
			default:
			}
			if !f.forget(u) {
				f.drain(&u)
				return
			}
		}
	}
}

// drain makes one attempt to forget first (the lease being retried when
// close came, if any) and each lease still queued, until drainBy; the rest
// are dropped to expire with their TTL.
func (f *forgetter) drain(first *unread) {
	f.mu.Lock()
	by := f.drainBy
	f.mu.Unlock()
	try := func(u unread) {
		switch {
		case !time.Now().Before(u.expires):
			f.metrics.unread(unreadExpired)
			return
		case !time.Now().Before(by):
			f.metrics.unread(unreadDropped)
			return
		}
		dl := time.Now().Add(f.timeout)
		if by.Before(dl) {
			dl = by
		}
		ctx, cancel := context.WithDeadline(context.Background(), dl)
		err := f.proto.Forget(ctx, u.member)
		cancel()
		if err != nil {
			f.metrics.redisErrors.Inc()
			f.metrics.unread(unreadDropped)
			return
		}
		f.metrics.unread(unreadForgotten)
	}
	if first != nil {
		try(*first)
	}
	for {
		select {
		case u := <-f.queue:
			try(u)
		default:
			return
		}
	}
}

// forget retries until Redis has forgotten u or u has expired. It returns
// false when the forgetter is stopped.
func (f *forgetter) forget(u unread) bool {
	pause := forgetBackoffMin
	for {
		if !time.Now().Before(u.expires) {
			f.metrics.unread(unreadExpired)
			return true
		}
		ctx, cancel := context.WithTimeout(context.Background(), f.timeout)
		err := f.proto.Forget(ctx, u.member)
		cancel()
		if err == nil {
			f.metrics.unread(unreadForgotten)
			return true
		}
		f.metrics.redisErrors.Inc()
		t := time.NewTimer(pause)
		select {
		case <-f.stop:
			t.Stop()
			return false
		case <-t.C:
		}
		pause = min(2*pause, forgetBackoffMax)
	}
}
