package protocol

// Redis configured to evict keys breaks every promise the protocol makes:
// a lease, the published state or a job's version may disappear under
// memory pressure, and a fleet then runs more calls than its limit (BullMQ
// refuses to start on such a Redis for the same reason). Workers and the
// manager check it before they start.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

// NoEviction is the only maxmemory-policy under which Redis keeps every key.
const NoEviction = "noeviction"

// ErrEvictionPolicy says that a Redis node evicts keys (its
// maxmemory-policy is not noeviction). Errors from CheckNoEviction wrap it.
var ErrEvictionPolicy = errors.New("redis evicts keys")

// EvictionError names the node that evicts keys and its policy.
type EvictionError struct {
	Addr   string // the node's address, as the client knows it
	Policy string // its maxmemory-policy
}

func (e *EvictionError) Error() string {
	return fmt.Sprintf("redis %s has maxmemory-policy %s: it may evict Spillway's leases and state under memory pressure, "+
		"and the fleet would then run more calls than its limit; set maxmemory-policy noeviction", e.Addr, e.Policy)
}

func (e *EvictionError) Unwrap() error { return ErrEvictionPolicy }

// CheckNoEviction reads INFO memory (which works where CONFIG is renamed or
// disabled, as on most managed Redis) on every master the client writes to:
// the server, each Cluster master, or each Ring shard. It returns an
// *EvictionError for the first one whose maxmemory_policy is not
// noeviction, or the error that kept it from reading one.
func CheckNoEviction(ctx context.Context, rdb redis.UniversalClient) error {
	check := func(ctx context.Context, c *redis.Client) error {
		info, err := c.Info(ctx, "memory").Result()
		if err != nil {
			return fmt.Errorf("failed to read the maxmemory-policy of redis %s: %w", c.Options().Addr, err)
		}
		policy := infoField(info, "maxmemory_policy")
		if policy == "" {
			return nil // a server that does not say (no eviction of its own)
		}
		if policy != NoEviction {
			return &EvictionError{Addr: c.Options().Addr, Policy: policy}
		}
		return nil
	}
	// ForEachMaster and ForEachShard run fn concurrently: keep the first
	// eviction found, else the first error.
	var mu sync.Mutex
	var evicting *EvictionError
	each := func(ctx context.Context, c *redis.Client) error {
		err := check(ctx, c)
		var ee *EvictionError
		if errors.As(err, &ee) {
			mu.Lock()
			if evicting == nil {
				evicting = ee
			}
			mu.Unlock()
			return nil
		}
		return err
	}
	var err error
	switch c := rdb.(type) {
	case *redis.ClusterClient:
		err = c.ForEachMaster(ctx, each)
	case *redis.Ring:
		err = c.ForEachShard(ctx, each)
	case *redis.Client:
		err = each(ctx, c)
	default:
		info, ierr := rdb.Info(ctx, "memory").Result()
		if ierr != nil {
			return fmt.Errorf("failed to read the maxmemory-policy of redis: %w", ierr)
		}
		if p := infoField(info, "maxmemory_policy"); p != "" && p != NoEviction {
			return &EvictionError{Addr: "(unknown)", Policy: p}
		}
	}
	if evicting != nil {
		return evicting
	}
	return err
}

// infoField is the value of key in an INFO reply, "" when absent.
func infoField(info, key string) string {
	for line := range strings.SplitSeq(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimRight(line, "\r"), key+":"); ok {
			return v
		}
	}
	return ""
}
