// Package clock declares the one clock interface that Spillway's
// time-driven code reads: the breaker and the ramp (internal/breaker,
// internal/ramp), the control law, the service middleware (pkg/shed), the
// worker library (pkg/guard) and the controller run on System; the simulator
// runs the same code on a virtual clock, and tests on a fake one.
//
// It imports only the standard library, so a service in another module can
// implement Clock for its tests.
package clock

import "time"

// Clock supplies the current time. Implementations must be safe for
// concurrent use when the code they are given to is.
type Clock interface {
	Now() time.Time
}

// System is the system clock: time.Now.
type System struct{}

// Now returns time.Now().
func (System) Now() time.Time { return time.Now() }
