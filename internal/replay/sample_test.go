package replay

import (
	"strings"
	"testing"
	"time"
)

func TestSampleStringShowsNoLimitWithoutSpillway(t *testing.T) {
	base := Sample{At: 3500 * time.Millisecond, Phase: "outage", Replicas: 5, MinReplicas: 5, MaxReplicas: 5, Capacity: 10}
	cases := []struct {
		name         string
		state        string
		limit        int64
		want, forbid string
	}{
		{name: "unprotected", want: "breaker=-        limit=-   ", forbid: "limit=0"},
		{name: "open breaker", state: "Open", limit: 0, want: "breaker=Open     limit=0   "},
		{name: "ramping", state: "Ramping", limit: 5, want: "breaker=Ramping  limit=5   "},
		{name: "closed", state: "Closed", limit: 1000, want: "breaker=Closed   limit=1000 "},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := base
			s.State, s.Limit = c.state, c.limit
			line := s.String()
			if !strings.Contains(line, c.want) {
				t.Errorf("%q does not contain %q", line, c.want)
			}
			if c.forbid != "" && strings.Contains(line, c.forbid) {
				t.Errorf("%q contains %q", line, c.forbid)
			}
		})
	}
}
