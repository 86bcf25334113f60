package wire

import "testing"

func TestState(t *testing.T) {
	for _, tc := range []struct {
		s              State
		valid, breaker bool
		under          State
	}{
		{Closed, true, true, Closed},
		{Open, true, true, Open},
		{HalfOpen, true, true, HalfOpen},
		{Ramping, true, false, Closed},
		{"", false, false, ""},
		{"closed", false, false, "closed"},
	} {
		if got := tc.s.Valid(); got != tc.valid {
			t.Errorf("%q.Valid() = %v, want %v", tc.s, got, tc.valid)
		}
		if got := tc.s.IsBreakerState(); got != tc.breaker {
			t.Errorf("%q.IsBreakerState() = %v, want %v", tc.s, got, tc.breaker)
		}
		if got := tc.s.BreakerState(); got != tc.under {
			t.Errorf("%q.BreakerState() = %q, want %q", tc.s, got, tc.under)
		}
	}
}
