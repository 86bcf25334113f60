package shed

import (
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

const metricPrefix = "spillway_service_"

// attemptLabels are the values of the attempt label; the last one collects
// every attempt from 4 on, keeping the cardinality bounded.
var attemptLabels = [...]string{"1", "2", "3", "4+"}

// allReasons lists every Reason, so that each shed_total series exists from
// the start.
var allReasons = [...]Reason{ReasonOverload, ReasonQueueTimeout, ReasonQuota, ReasonDeadline, ReasonRamp, ReasonCanceled}

// Values of the header label of malformed_headers_total.
const (
	headerAttempt  = "attempt"
	headerDeadline = "deadline"
)

// metrics holds the counters, resolved once so the hot path only does atomic
// adds. They exist whether or not they are registered.
type metrics struct {
	requests          [len(attemptLabels)]prometheus.Counter
	admitted          prometheus.Counter
	shed              map[Reason]prometheus.Counter
	malformedAttempt  prometheus.Counter
	malformedDeadline prometheus.Counter
	collectors        []prometheus.Collector
}

func newMetrics(s *Shedder) *metrics {
	requests := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: metricPrefix + "requests_total",
		Help: "Requests seen by the service, by attempt number (4+ collects the rest).",
	}, []string{"attempt"})
	shed := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: metricPrefix + "shed_total",
		Help: "Requests rejected before reaching the handler, by reason.",
	}, []string{"reason"})
	malformed := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: metricPrefix + "malformed_headers_total",
		Help: "Requests whose attempt or deadline header could not be parsed and was ignored.",
	}, []string{"header"})
	m := &metrics{
		admitted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: metricPrefix + "admitted_total",
			Help: "Requests admitted to the handler.",
		}),
		shed:              make(map[Reason]prometheus.Counter, len(allReasons)),
		malformedAttempt:  malformed.WithLabelValues(headerAttempt),
		malformedDeadline: malformed.WithLabelValues(headerDeadline),
	}
	for i, l := range attemptLabels {
		m.requests[i] = requests.WithLabelValues(l)
	}
	for _, r := range allReasons {
		m.shed[r] = shed.WithLabelValues(string(r))
	}
	m.collectors = []prometheus.Collector{requests, shed, malformed, m.admitted}
	m.collectors = append(m.collectors, gauges(s)...)
	return m
}

// gauges returns the gauges computed at scrape time from the Shedder's state.
func gauges(s *Shedder) []prometheus.Collector {
	return []prometheus.Collector{
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: metricPrefix + "amplification_ratio",
			Help: "Requests divided by first attempts over the last minute; 0 when the minute saw no request.",
		}, func() float64 { return s.ratio.ratio(s.clock.Now()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: metricPrefix + "in_flight",
			Help: "Requests admitted and not yet finished.",
		}, func() float64 { return float64(s.Stats().InFlight) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: metricPrefix + "queue_depth",
			Help: "Requests waiting in the admission queue.",
		}, func() float64 { return float64(s.Stats().Queued) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: metricPrefix + "limit",
			Help: "Effective concurrency limit: MaxInFlight, or the ramp step while the ramp climbs.",
		}, func() float64 { return float64(s.limit()) }),
	}
}

func (m *metrics) register(reg prometheus.Registerer) error {
	for _, c := range m.collectors {
		if err := reg.Register(c); err != nil {
			return fmt.Errorf("failed to register service metrics: %w", err)
		}
	}
	return nil
}

// attemptIndex maps an attempt number to its label index.
func attemptIndex(attempt int) int {
	return min(max(attempt, 1), len(attemptLabels)) - 1
}

// ratioSeconds is the length of the amplification-ratio window, one bucket
// per second.
const ratioSeconds = 60

// ratioWindow counts requests and first attempts per second over the last
// minute. Adds are lock-free; a bucket is reset under mu when it is reused
// for a new second.
type ratioWindow struct {
	mu      sync.Mutex
	buckets [ratioSeconds]ratioBucket
}

type ratioBucket struct {
	sec   atomic.Int64
	total atomic.Uint64
	first atomic.Uint64
}

func newRatioWindow() *ratioWindow {
	w := &ratioWindow{}
	for i := range w.buckets {
		w.buckets[i].sec.Store(math.MinInt64)
	}
	return w
}

// add counts one request at now.
func (w *ratioWindow) add(now time.Time, first bool) {
	sec := now.Unix()
	b := &w.buckets[uint64(sec)%ratioSeconds]
	if cur := b.sec.Load(); cur != sec {
		if cur > sec {
			return // a request from a second that has already left the window
		}
		w.reset(b, sec)
	}
	b.total.Add(1)
	if first {
		b.first.Add(1)
	}
}

func (w *ratioWindow) reset(b *ratioBucket, sec int64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if b.sec.Load() < sec {
		b.total.Store(0)
		b.first.Store(0)
		b.sec.Store(sec)
	}
}

// ratio returns requests / first attempts over the minute ending at now, or
// 0 without requests. Without first attempts it returns the request count, as
// if one first attempt had been seen, so that an all-retries minute reads
// high rather than as no data.
func (w *ratioWindow) ratio(now time.Time) float64 {
	sec := now.Unix()
	var total, first uint64
	for i := range w.buckets {
		b := &w.buckets[i]
		if s := b.sec.Load(); s > sec-ratioSeconds && s <= sec {
			total += b.total.Load()
			first += b.first.Load()
		}
	}
	if total == 0 {
		return 0
	}
	return float64(total) / float64(max(first, 1))
}
