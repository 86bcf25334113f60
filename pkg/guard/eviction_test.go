package guard_test

import (
	"errors"
	"testing"

	. "github.com/onsi/gomega"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// A Redis that evicts keys (maxmemory-policy other than noeviction) may
// drop leases and the published state under memory pressure, and the fleet
// would then run more calls than its limit: guard.New refuses it with an
// error that says what to change, in both modes. With AllowEviction the
// guard starts and says so on the spillway_worker_redis_evicting gauge.
func TestNewRefusesARedisThatEvictsKeys(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		g := NewWithT(t)
		rdb := fastClient(redistest.Start(t, redistest.WithArgs("--maxmemory-policy", "allkeys-lru")))
		publish(t, rdb, defaultPublished(5))

		_, err := guard.New(rdb, dep, guard.Options{Batch: batch})
		g.Expect(err).To(HaveOccurred(), "a guard started on a Redis that evicts keys")
		g.Expect(errors.Is(err, protocol.ErrEvictionPolicy)).To(BeTrue(), "%v", err)
		g.Expect(err.Error()).To(And(ContainSubstring("allkeys-lru"), ContainSubstring("noeviction"), ContainSubstring("AllowEviction")))

		reg := prometheus.NewRegistry()
		gd := newGuard(t, rdb, guard.Options{AllowEviction: true, Registerer: reg, Batch: batch})
		g.Expect(gd.Do(t.Context(), guard.Job{}, ok)).To(Succeed())
		g.Expect(gauge(t, reg, "spillway_worker_redis_evicting")).To(Equal(1.0))
	})
}

// On a Redis that keeps every key, the gauge says 0.
func TestEvictingGaugeIsZeroOnNoEviction(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	reg := prometheus.NewRegistry()
	newGuard(t, rdb, guard.Options{Registerer: reg})
	g.Expect(gauge(t, reg, "spillway_worker_redis_evicting")).To(Equal(0.0))
}
