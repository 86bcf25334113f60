package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	ctrl "sigs.k8s.io/controller-runtime"

	"github.com/spillway-dev/spillway/pkg/protocol"
)

// evictingGauge is 1 while the manager runs, with --redis-allow-eviction,
// on a Redis that evicts keys.
var evictingGauge = prometheus.NewGauge(prometheus.GaugeOpts{
	Namespace: "spillway", Name: "redis_evicting",
	Help: "1 when the manager started (--redis-allow-eviction) on a Redis whose maxmemory-policy evicts keys: leases and the published state may disappear, and the fleet's limits no longer hold.",
})

// checkRedisEviction refuses a Redis that evicts keys (protocol.CheckNoEviction,
// on every master), unless o.allowEviction: then it logs the danger and sets
// the spillway_redis_evicting gauge, registered with reg. A Redis that does
// not answer within o.timeout is not waited for: the evaluator reports it.
func checkRedisEviction(ctx context.Context, rdb redis.UniversalClient, o redisOptions, reg prometheus.Registerer) error {
	if err := reg.Register(evictingGauge); err != nil {
		var are prometheus.AlreadyRegisteredError
		if !errors.As(err, &are) {
			return fmt.Errorf("failed to register spillway_redis_evicting: %w", err)
		}
	}
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	err := protocol.CheckNoEviction(ctx, rdb)
	var ee *protocol.EvictionError
	switch {
	case errors.As(err, &ee) && !o.allowEviction:
		return fmt.Errorf("%w (or start with --redis-allow-eviction, and alert on spillway_redis_evicting)", err)
	case errors.As(err, &ee):
		evictingGauge.Set(1)
		ctrl.Log.WithName("setup").Info("Redis evicts keys: the fleet's limits no longer hold under memory pressure",
			"redis", ee.Addr, "maxmemoryPolicy", ee.Policy)
	case err != nil:
		evictingGauge.Set(0)
		ctrl.Log.WithName("setup").Info("Could not read Redis's maxmemory-policy at start-up", "error", err.Error())
	default:
		evictingGauge.Set(0)
	}
	return nil
}
