package guard

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/spillway-dev/spillway/pkg/protocol"
)

// processID names this process in the registry of worker processes
// (protocol.Client.Register): one id per process, whatever its guards.
var processID = protocol.NewLeaseID()

// registrar registers the process for the guard's dependency, so that the
// manager and `spillway status` see which protocol versions the fleet speaks:
// at the guard's first call and every protocol.RegisterEvery after, in the
// background and one at a time, never on a call's path. A registration that
// fails (Redis unavailable) is tried again a second later.
type registrar struct {
	proto   *protocol.Client
	timeout time.Duration
	next    atomic.Int64 // Unix ns of the next registration due
	busy    atomic.Bool
}

// maybe starts a registration when one is due at now.
func (r *registrar) maybe(now time.Time) {
	if now.UnixNano() < r.next.Load() || !r.busy.CompareAndSwap(false, true) {
		return
	}
	go func() {
		defer r.busy.Store(false)
		ctx, cancel := context.WithTimeout(context.Background(), r.timeout)
		defer cancel()
		every := protocol.RegisterEvery
		if err := r.proto.Register(ctx, "go", processID); err != nil {
			every = time.Second
		}
		r.next.Store(time.Now().Add(every).UnixNano())
	}()
}
