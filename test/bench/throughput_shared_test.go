package bench

import (
	"fmt"
	"os"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"
)

// tpShared is the dependency's bookkeeping, shared by every worker process of
// the throughput harness through one memory-mapped file: the calls in flight
// at the dependency across the whole fleet, their peak, the calls made, and
// the fleet's remaining quota of calls. A counter in shared memory costs a
// call tens of nanoseconds where a dependency behind a socket would cost tens
// of microseconds, so it can count a fleet at hundreds of thousands of calls
// per second without becoming the bottleneck it measures. The time calls
// spend in the dependency is summed too, for calls that take time.
type tpShared struct {
	mem []byte
}

// The counters' offsets. The dependency's three counters share a cache line
// (a call touches all three); the quota, which every call also takes from,
// has a line of its own so that the two contended lines do not pass one
// another's writes back and forth.
const (
	tpInFlight  = 0
	tpPeak      = 8
	tpCalls     = 16
	tpOverLimit = 24
	tpBusy      = 32
	tpRemaining = 128
	tpSharedLen = 4096
)

// tpCreateShared makes the shared file at path, zeroed, and maps it.
func tpCreateShared(path string) (*tpShared, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }()
	if err := f.Truncate(tpSharedLen); err != nil {
		return nil, err
	}
	return tpMap(f)
}

// tpOpenShared maps the shared file a parent made.
func tpOpenShared(path string) (*tpShared, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }()
	return tpMap(f)
}

func tpMap(f *os.File) (*tpShared, error) {
	mem, err := syscall.Mmap(int(f.Fd()), 0, tpSharedLen, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap %s: %w", f.Name(), err)
	}
	return &tpShared{mem: mem}, nil
}

// close unmaps the file; the counters must not be used after.
func (s *tpShared) close() { _ = syscall.Munmap(s.mem) }

// counter is the 64-bit counter at off. mmap returns page-aligned memory, so
// every offset above is 8-byte aligned, as sync/atomic requires.
func (s *tpShared) counter(off int) *atomic.Int64 {
	return (*atomic.Int64)(unsafe.Pointer(&s.mem[off]))
}

// enter counts a call arriving at the dependency: in flight, the peak, the
// call, and whether it found more calls in flight than limit (limit 0: no
// limit applies, as for bare calls).
func (s *tpShared) enter(limit int64) {
	n := s.counter(tpInFlight).Add(1)
	peak := s.counter(tpPeak)
	for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
	}
	s.counter(tpCalls).Add(1)
	if limit > 0 && n > limit {
		s.counter(tpOverLimit).Add(1)
	}
}

// busy adds d, the time a call spent in the dependency, to the fleet's total:
// over the run's length, the calls in flight on average.
func (s *tpShared) busy(d time.Duration) { s.counter(tpBusy).Add(int64(d)) }

// leave counts a call leaving the dependency.
func (s *tpShared) leave() { s.counter(tpInFlight).Add(-1) }

// take takes one call from the fleet's quota; false when it is spent.
func (s *tpShared) take() bool { return s.counter(tpRemaining).Add(-1) >= 0 }

// giveBack returns a call taken with take that was not made (refused).
func (s *tpShared) giveBack() { s.counter(tpRemaining).Add(1) }
