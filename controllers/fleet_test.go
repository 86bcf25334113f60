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
		nothing   bool
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
		name: "invalid spec and nothing published: nothing to release", paramsErr: errors.New("bad"), nothing: true,
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			got, ok := releasedState(params, tt.paramsErr, tt.prev, tt.found, now)
			g.Expect(ok).To(Equal(!tt.nothing))
			g.Expect(got).To(Equal(tt.want))
		})
	}
}
