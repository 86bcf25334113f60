package skewtest

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// keyPrefix is the prefix of a dependency's keys: version 4's, which
// version 5 keeps (docs/protocol.md §1), so that the two versions share one
// cap. The skew tests read the keys themselves, with no client of either
// version between.
const keyPrefix = "spillway:v4:"

// State is what the controller published, read from the state hash.
type State struct {
	Version  string
	State    string
	Limit    int64
	Epoch    int64
	Seq      int64
	RampStep int64 // ctrl_ramp_step
	// Trip is the in-path trip's bookkeeping, for the logs: tripped_at_ms,
	// tripped_from, and (version 5 on) trip_count and trip_acked_count.
	Trip string
	Seen time.Time
}

func (s State) String() string {
	return fmt.Sprintf("%s v%s seq %d epoch %d %s/%d step %d (trip %s)", s.Seen.Format("15:04:05.000"), s.Version, s.Seq, s.Epoch, s.State, s.Limit, s.RampStep, s.Trip)
}

// ReadState reads the state hash of dep (namespace/name); false when there
// is none.
func ReadState(ctx context.Context, rdb redis.UniversalClient, dep string) (State, bool, error) {
	h, err := rdb.HGetAll(ctx, keyPrefix+"{"+dep+"}:state").Result()
	if err != nil {
		return State{}, false, fmt.Errorf("failed to read the state of %s: %w", dep, err)
	}
	if len(h) == 0 {
		return State{}, false, nil
	}
	n := func(f string) int64 { v, _ := strconv.ParseInt(h[f], 10, 64); return v }
	return State{
		Version: h["version"], State: h["state"], Limit: n("limit"), Epoch: n("epoch"), Seq: n("seq"),
		RampStep: n("ctrl_ramp_step"), Seen: time.Now(),
		Trip: fmt.Sprintf("at %s ms from %s, count %s; acknowledged at %s ms, count %s", h["tripped_at_ms"], h["tripped_from"], h["trip_count"], h["trip_acked_ms"], h["trip_acked_count"]),
	}, true, nil
}

// WatchStates polls the state hash of dep every 5ms until ctx ends and
// records every change of its sequence, state, limit or ramp step; the
// function it returns lists them.
func WatchStates(ctx context.Context, rdb redis.UniversalClient, dep string) func() []State {
	var mu sync.Mutex
	var seen []State
	go func() {
		var last State
		for ctx.Err() == nil {
			if s, ok, err := ReadState(ctx, rdb, dep); err == nil && ok &&
				(s.Seq != last.Seq || s.State != last.State || s.Limit != last.Limit || s.RampStep != last.RampStep) {
				last = s
				mu.Lock()
				seen = append(seen, s)
				mu.Unlock()
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()
	return func() []State {
		mu.Lock()
		defer mu.Unlock()
		return append([]State(nil), seen...)
	}
}

// LiveLeases counts the leases of dep that have not expired by Redis's
// clock: those a worker holds, or left behind.
func LiveLeases(ctx context.Context, rdb redis.UniversalClient, dep string) (int64, error) {
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		return 0, fmt.Errorf("failed to read Redis's time: %w", err)
	}
	n, err := rdb.ZCount(ctx, keyPrefix+"{"+dep+"}:leases", "("+strconv.FormatInt(now.UnixMilli(), 10), "+inf").Result()
	if err != nil {
		return 0, fmt.Errorf("failed to count the leases of %s: %w", dep, err)
	}
	return n, nil
}
