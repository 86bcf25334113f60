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

// link is the guard's own client for the round trips that put leases back
// after Redis lost them (docs/protocol.md §4 "Learning"): the holder's holds
// and the batch pool's refreshes. They must reach the new server within the
// learning second, which counts from the first script it runs.
//
// The user's client may not let them: after as many failed dials as its
// PoolSize, go-redis's pool fails every command at once and dials the
// server only once a second until a dial succeeds, so a holder behind it
// came back up to a second after Redis answered again. The link is a client
// built from the same options (address, Sentinel or Cluster discovery,
// dialer, TLS, credentials) with a pool of linkPoolSize connections that
// dials once per round trip. A failed round trip closes it, and the next
// builds a fresh one that dials at once: when Redis is tried again is the
// holder's schedule (holdRetryEvery, the pool's refresh interval) and
// nothing else. A client of another type (a Ring, a wrapper) is used as it
// is. Hooks added to the user's client (AddHook) do not run on the link.
type link struct {
	shared *protocol.Client
	dep    protocol.Dependency
	// build returns a new client of the user's options; nil when the
	// shared client is used.
	build func() redis.UniversalClient
	// reach, when set, dials the server before a client is built after a
	// failed round trip, and closes the connection: while the server
	// refuses, the round trip fails without a client, which go-redis would
	// log at every failed dial (20 lines a second at holdRetryEvery).
	reach func(context.Context) error

	mu     sync.Mutex
	cur    *protocol.Client
	rdb    redis.UniversalClient // cur's client
	down   bool                  // the last round trip on the link failed
	closed bool
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

// get returns the client to send on: the link's, built if none is open, or
// the shared one for a client of another type or after close. After a
// failed round trip it first reaches the server (reach), and fails when
// that fails.
func (l *link) get(ctx context.Context) (*protocol.Client, error) {
	if l.build == nil {
		return l.shared, nil
	}
	l.mu.Lock()
	cur, down, closed := l.cur, l.down, l.closed
	l.mu.Unlock()
	switch {
	case closed:
		return l.shared, nil
	case cur != nil:
		return cur, nil
	case down && l.reach != nil:
		if err := l.reach(ctx); err != nil {
			return nil, fmt.Errorf("failed to reach redis: %w", err)
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return l.shared, nil
	}
	if l.cur == nil {
		rdb := l.build()
		c, err := protocol.NewClient(rdb, l.dep)
		if err != nil { // the dependency was validated by New
			_ = rdb.Close()
			return nil, err
		}
		l.cur, l.rdb, l.down = c, rdb, false
	}
	return l.cur, nil
}

// failed closes c, when it is the link's, after a round trip on it failed:
// the next get dials afresh.
func (l *link) failed(c *protocol.Client) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if c != l.cur || l.cur == nil {
		return
	}
	_ = l.rdb.Close()
	l.cur, l.rdb, l.down = nil, nil, true
}

// close closes the link's client; later round trips go on the shared one.
func (l *link) close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.closed = true
	if l.rdb != nil {
		_ = l.rdb.Close()
	}
	l.cur, l.rdb = nil, nil
}

// answered reports whether a pool round trip's error is the script's answer
// (a refusal), which says the link works.
func answered(err error) bool {
	return errors.Is(err, protocol.ErrLate) || errors.Is(err, protocol.ErrNoPolicy) || errors.Is(err, protocol.ErrVersion)
}
