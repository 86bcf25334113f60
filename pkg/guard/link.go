package guard

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/protocol"
)

// link carries the round trips that put leases back after Redis lost them
// (docs/protocol.md §4 "Learning"): the holder's holds and the batch pool's
// refreshes. They must reach the new server within the learning second,
// which counts from the first script it runs.
//
// They go on the user's client while it works. It may not let them back in
// time: after as many failed dials as its PoolSize, go-redis's pool fails
// every command at once and dials the server only once a second until a
// dial succeeds, so a holder behind it came back up to a second after Redis
// answered again. After a round trip on the user's client failed, the next
// go on a client of the link's own, built from the same options (address,
// Sentinel or Cluster discovery, dialer, TLS, credentials) with a small
// pool that dials once per attempt, and closed after each round trip: a
// failed one so that the next dials afresh, a successful one to turn back
// to the user's client. When Redis is tried again is then the holder's
// schedule (holdRetryEvery, the pool's refresh interval) and nothing else,
// and no connection is added while the user's client works. A client of
// another type (a Ring, a wrapper) is used as it is. Hooks added to the
// user's client (AddHook) do not run on the link's.
type link struct {
	shared *protocol.Client
	dep    protocol.Dependency
	// build returns a new client of the user's options; nil when the
	// shared client is used.
	build func() redis.UniversalClient
	// reach, when set, dials the server before the link's client is built,
	// and closes the connection: while the server refuses, the round trip
	// fails without a client, which go-redis would log at every failed dial
	// (20 lines a second at holdRetryEvery).
	reach func(context.Context) error

	mu      sync.Mutex
	failing bool // the last round trip on the user's client failed
	cur     *protocol.Client
	rdb     redis.UniversalClient // cur's client
	closed  bool
}

// linkPoolSize: a hold and a refresh may run at once.
const linkPoolSize = 2

func newLink(rdb redis.UniversalClient, dep protocol.Dependency, shared *protocol.Client) *link {
	l := &link{shared: shared, dep: dep}
	switch c := rdb.(type) {
	case *redis.Client:
		o := *c.Options()
		linkPool(&o.PoolSize, &o.MinIdleConns, &o.MaxIdleConns, &o.MaxActiveConns, &o.DialerRetries)
		asGiven(&o.ReadTimeout, &o.WriteTimeout, &o.MinRetryBackoff, &o.MaxRetryBackoff)
		if o.MaxRetries == 0 { // -1 given
			o.MaxRetries = -1
		}
		o.PushNotificationProcessor = nil
		l.build = func() redis.UniversalClient { return redis.NewClient(&o) }
		l.reach = func(ctx context.Context) error {
			ctx, cancel := context.WithTimeout(ctx, o.DialTimeout)
			defer cancel()
			conn, err := o.Dialer(ctx, o.Network, o.Addr)
			if err != nil {
				return err
			}
			return conn.Close()
		}
	case *redis.ClusterClient:
		o := *c.Options()
		linkPool(&o.PoolSize, &o.MinIdleConns, &o.MaxIdleConns, &o.MaxActiveConns, &o.DialerRetries)
		asGiven(&o.ReadTimeout, &o.WriteTimeout, &o.MinRetryBackoff, &o.MaxRetryBackoff)
		if o.MaxRedirects == 0 { // -1 given
			o.MaxRedirects = -1
		}
		o.PushNotificationProcessor = nil
		l.build = func() redis.UniversalClient {
			o := o // NewClusterClient keeps and initialises its options
			if o.MaintNotificationsConfig != nil {
				m := *o.MaintNotificationsConfig
				o.MaintNotificationsConfig = &m
			}
			return redis.NewClusterClient(&o)
		}
	}
	return l
}

// linkPool sizes the link's pool (per node in a cluster): linkPoolSize
// connections, none opened in advance, one dial per attempt. Retries are
// the user's: a reply lost to a broken connection is resent at once, as on
// the user's client (the scripts are idempotent under resends).
func linkPool(poolSize, minIdle, maxIdle, maxActive, dialerRetries *int) {
	*poolSize, *minIdle, *maxIdle, *maxActive, *dialerRetries = linkPoolSize, 0, linkPoolSize, linkPoolSize, 1
}

// asGiven undoes what go-redis did to durations that mean "none" when it
// initialised the user's options (-1 became 0, and a timeout's -2 became
// -1): the link's client initialises them again, and would otherwise read
// 0 as "the default".
func asGiven(timeouts ...*time.Duration) {
	for _, d := range timeouts {
		switch *d {
		case 0:
			*d = -1
		case -1:
			*d = -2
		}
	}
}

// get returns the client for the next round trip: the user's, or, from a
// failed round trip on it until one succeeds on the link, the link's, which
// first reaches the server (reach) and fails when that fails.
func (l *link) get(ctx context.Context) (*protocol.Client, error) {
	if l.build == nil {
		return l.shared, nil
	}
	l.mu.Lock()
	cur, failing, closed := l.cur, l.failing, l.closed
	l.mu.Unlock()
	switch {
	case closed || !failing:
		return l.shared, nil
	case cur != nil:
		return cur, nil
	case l.reach != nil:
		if err := l.reach(ctx); err != nil {
			return nil, fmt.Errorf("failed to reach redis: %w", err)
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed || !l.failing {
		return l.shared, nil
	}
	if l.cur == nil {
		rdb := l.build()
		c, err := protocol.NewClient(rdb, l.dep)
		if err != nil { // the dependency was validated by New
			_ = rdb.Close()
			return nil, err
		}
		l.cur, l.rdb = c, rdb
	}
	return l.cur, nil
}

// done records how a round trip on c (from get) ended: a failure on the
// user's client turns the next round trips to the link; any round trip on
// the link closes its client, and a successful one turns back to the
// user's client.
func (l *link) done(c *protocol.Client, err error) {
	if l.build == nil {
		return
	}
	ok := err == nil || answered(err)
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case c == l.shared:
		if !ok {
			l.failing = true
		}
	case c == l.cur:
		_ = l.rdb.Close()
		l.cur, l.rdb = nil, nil
		if ok {
			l.failing = false
		}
	}
}

// onLink runs f on the client l.get returns, and tells l how it ended.
func onLink[T any](ctx context.Context, l *link, f func(*protocol.Client) (T, error)) (T, error) {
	c, err := l.get(ctx)
	if err != nil {
		var zero T
		return zero, err
	}
	v, err := f(c)
	l.done(c, err)
	return v, err
}

// close closes the link's client; later round trips go on the user's.
func (l *link) close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.closed = true
	if l.rdb != nil {
		_ = l.rdb.Close()
	}
	l.cur, l.rdb = nil, nil
}

// answered reports whether a round trip's error is the script's answer (a
// refusal): the client reached Redis.
func answered(err error) bool {
	return errors.Is(err, protocol.ErrLate) || errors.Is(err, protocol.ErrNoPolicy) || errors.Is(err, protocol.ErrVersion)
}
