package wire

// State is the fleet's state for one dependency: the state of its circuit
// breaker, or Ramping. The controller decides it, publishes it in Redis (the
// "state" field of docs/protocol.md) and in the DependencyPolicy status, and
// workers enforce it. The string values are those the protocol and the API
// use.
//
// Closed, Open and HalfOpen are the breaker's states (internal/breaker
// moves between only these three). Ramping is not a breaker state: it is a
// Closed breaker whose slow start has not reached full capacity, which the
// fleet publishes apart because it admits fewer calls.
type State string

const (
	// Closed admits calls up to the full capacity.
	Closed State = "Closed"
	// Open admits no calls: workers fail fast.
	Open State = "Open"
	// HalfOpen admits only the probe calls that test recovery.
	HalfOpen State = "HalfOpen"
	// Ramping admits calls up to the current ramp step; the breaker under it
	// is Closed.
	Ramping State = "Ramping"
)

// Valid reports whether s is one of the four states.
func (s State) Valid() bool {
	return s.IsBreakerState() || s == Ramping
}

// IsBreakerState reports whether s is a state of the breaker itself: Closed,
// Open or HalfOpen.
func (s State) IsBreakerState() bool {
	return s == Closed || s == Open || s == HalfOpen
}

// BreakerState is the breaker's state under s: Closed for Ramping, s itself
// otherwise.
func (s State) BreakerState() State {
	if s == Ramping {
		return Closed
	}
	return s
}
