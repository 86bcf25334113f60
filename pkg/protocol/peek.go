package protocol

import (
	"context"
	"fmt"
	"strconv"
	"time"
)

// statsSuffixes are the per-second counters of the stats hash
// (docs/protocol.md §1 "Stats counters"; lib.lua suffixes()), in the order
// PeekWindow sums them.
var statsSuffixes = [...]string{"s", "f", "t", "a1", "a2", "a3", "a4", "g", "b", "ds", "dn"}

// peekBatch bounds the fields of one HMGET, as lib.lua's sum does.
const peekBatch = 4000

// PeekWindow sums the per-second counters over the seconds (now - length,
// now] (length in whole seconds, at least one), as ReadWindow does for a
// sliding window, with plain HMGETs of the stats hash: it writes nothing.
// ReadWindow runs the window script, which keeps cached totals in the hash,
// prunes old counters and sweeps expired leases: the controller's
// bookkeeping, which a reader that is not the controller (spillway status)
// should leave alone, and which a Redis user allowed only to read may not
// do. now is Redis's time on the node that holds the dependency's keys, as
// ReadPublishedAt returns it.
//
// It reads every second of the window, 11 fields a second (330 for the
// default 30 s breaker window, in batches of at most 4000 for a long one):
// the controller's cached totals and the minute totals are bookkeeping of
// its own, and the per-second counters stay until the window and a minute
// have passed.
func (c *Client) PeekWindow(ctx context.Context, length time.Duration, now time.Time) (Window, error) {
	nowS := now.Unix()
	var totals [len(statsSuffixes)]int64
	fields := make([]string, 0, min(peekBatch, int(seconds(length))*len(statsSuffixes)))
	flush := func() error {
		if len(fields) == 0 {
			return nil
		}
		vals, err := c.rdb.HMGet(ctx, c.keys.Stats, fields...).Result()
		if err != nil {
			return fmt.Errorf("failed to read the window of %s: %w", c.dep, err)
		}
		for i, v := range vals {
			if v == nil {
				continue
			}
			s, _ := v.(string)
			n, err := strconv.ParseInt(s, 10, 64)
			if err != nil {
				return fmt.Errorf("failed to read the window of %s: counter %s is %q, not an integer", c.dep, fields[i], s)
			}
			totals[i%len(statsSuffixes)] += n
		}
		fields = fields[:0]
		return nil
	}
	for s := nowS - seconds(length) + 1; s <= nowS; s++ {
		prefix := strconv.FormatInt(s, 10) + ":"
		for _, suffix := range statsSuffixes {
			fields = append(fields, prefix+suffix)
		}
		if len(fields)+len(statsSuffixes) > peekBatch {
			if err := flush(); err != nil {
				return Window{}, err
			}
		}
	}
	if err := flush(); err != nil {
		return Window{}, err
	}
	return Window{
		Calls:          totals[0] + totals[1] + totals[2],
		Successes:      totals[0],
		Failures:       totals[1],
		Timeouts:       totals[2],
		ByAttempt:      [4]int64{totals[3], totals[4], totals[5], totals[6]},
		RetriesGranted: totals[7],
		BudgetRefused:  totals[8],
		SuccessMicros:  totals[9],
		TimedSuccesses: totals[10],
	}, nil
}
