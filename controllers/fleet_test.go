package controllers

import (
	"errors"
	"testing"
	"time"

	. "github.com/onsi/gomega"

	"github.com/spillway-dev/spillway/pkg/protocol"
	"github.com/spillway-dev/spillway/pkg/wire"
)

func TestReleasedState(t *testing.T) {
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	params := seedParams(t)
	open := protocol.Published{State: wire.Open, Limit: 0, Capacity: 30, Epoch: 7, OpenUntil: now.Add(time.Minute), BreakerSince: now.Add(-time.Second), RampStep: 0}
	tests := []struct {
		name      string
		paramsErr error
		prev      protocol.Published
		found     bool
		want      protocol.Published
		wantErr   bool
	}{{
		name: "open, from the spec", prev: open, found: true,
		want: protocol.Published{State: wire.Closed, Limit: 40, Capacity: 40, Epoch: 9, Backoff: params.Backoff, Budget: params.Budget,
			BreakerWindow: params.Breaker.Window, BreakerSince: now, RampStep: len(params.Ramp.Steps) - 1, RampStepStarted: now},
	}, {
		name: "Redis lost its data", found: false,
		want: protocol.Published{State: wire.Closed, Limit: 40, Capacity: 40, Epoch: 2, Backoff: params.Backoff, Budget: params.Budget,
			BreakerWindow: params.Breaker.Window, BreakerSince: now, RampStep: len(params.Ramp.Steps) - 1, RampStepStarted: now},
	}, {
		name: "invalid spec: what was published", paramsErr: errors.New("bad"), prev: open, found: true,
		want: protocol.Published{State: wire.Closed, Limit: 30, Capacity: 30, Epoch: 9, BreakerSince: now, RampStepStarted: now},
	}, {
		name: "invalid spec and nothing published", paramsErr: errors.New("bad"), wantErr: true,
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			got, err := releasedState(params, tt.paramsErr, tt.prev, tt.found, now)
			if tt.wantErr {
				g.Expect(err).To(HaveOccurred())
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(got).To(Equal(tt.want))
		})
	}
}

func TestSafeState(t *testing.T) {
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	for _, prev := range []protocol.Published{
		{State: wire.Open, Limit: 0, Capacity: 40, Epoch: 3, OpenUntil: now.Add(time.Minute), BreakerSince: now.Add(-time.Second)},
		{State: wire.HalfOpen, Limit: 3, Capacity: 40, Epoch: 4},
		{State: wire.Ramping, Limit: 10, Capacity: 40, Epoch: 5, RampStep: 1},
	} {
		g := NewWithT(t)
		got, changed := safeState(prev, now)
		g.Expect(changed).To(BeTrue(), "%s", prev.State)
		g.Expect(got.State).To(Equal(wire.Closed))
		g.Expect(got.Limit).To(Equal(int64(40)))
		g.Expect(got.Epoch).To(Equal(prev.Epoch+1), "a transition takes the next epoch")
		g.Expect(got.OpenUntil.IsZero()).To(BeTrue())
	}
	closed := protocol.Published{State: wire.Closed, Limit: 40, Capacity: 40, Epoch: 6}
	got, changed := safeState(closed, now)
	NewWithT(t).Expect(changed).To(BeFalse())
	NewWithT(t).Expect(got).To(Equal(closed))
}
