// Command worker is the skew tests' worker program (internal/skewtest): a
// process that makes one guard (pkg/guard) for a dependency and calls it
// from a few goroutines in a loop, acting on the guard's decisions as a job
// framework would, with the delays capped so the tests stay short.
//
// The tests build this one file twice: against this tree, and against the
// tree of an older commit (go build <this file> run inside that tree), so
// that the guard it links is that commit's. It uses only the guard's public
// API, which both versions share.
//
// It writes JSON lines prefixed "skew: " on stdout: {"seen": ...} whenever
// what the guard tells it changes ("open" for a refusal because the breaker
// is open, "limit=N" for an admission at the fleet-wide limit N), and
// {"stats": ...} every 200ms and once more when it stops. It stops, ending
// its calls and closing the guard, when its stdin closes.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// stats are the worker's counts; Refused is by reason ("slots", "rate",
// "open", "redis_unavailable", "no_policy", "version", or the error's text
// for anything else).
type stats struct {
	OK      int64            `json:"ok"`
	Failed  int64            `json:"failed"`
	Retry   int64            `json:"retry"`
	Park    int64            `json:"park"`
	Drop    int64            `json:"drop"`
	Refused map[string]int64 `json:"refused"`
}

type line struct {
	Seen  string `json:"seen,omitempty"`
	AtMS  int64  `json:"at_ms,omitempty"`
	Stats *stats `json:"stats,omitempty"`
}

func main() {
	redisAddr := flag.String("redis", "", "Redis address")
	dep := flag.String("dependency", "", "the dependency, namespace/name")
	url := flag.String("url", "", "the dependency's URL")
	threads := flag.Int("threads", 4, "goroutines calling")
	batch := flag.Bool("batch", false, "batch mode (guard.Options.Batch)")
	name := flag.String("name", "", "the worker's name, sent as X-Worker")
	flag.Parse()

	rdb := redis.NewClient(&redis.Options{Addr: *redisAddr, ContextTimeoutEnabled: true})
	defer rdb.Close()
	gd, err := guard.New(rdb, *dep, guard.Options{Batch: guard.BatchOptions{Enabled: *batch}})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	ctx, stop := context.WithCancel(context.Background())
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		stop()
	}()

	var mu sync.Mutex
	st := stats{Refused: map[string]int64{}}
	seen := ""
	emit := func(l line) {
		b, _ := json.Marshal(l)
		fmt.Fprintf(os.Stdout, "skew: %s\n", b)
	}
	observe := func(s string) {
		mu.Lock()
		defer mu.Unlock()
		if s != seen {
			seen = s
			emit(line{Seen: s, AtMS: time.Now().UnixMilli()})
		}
	}
	report := func() {
		mu.Lock()
		defer mu.Unlock()
		emit(line{Stats: &st})
	}
	count := func(f func(*stats)) {
		mu.Lock()
		f(&st)
		mu.Unlock()
	}
	client := &http.Client{Timeout: 5 * time.Second}
	call := func(ctx context.Context, limit int64) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, *url, nil)
		if err != nil {
			return err
		}
		req.Header.Set("X-Worker", *name)
		req.Header.Set("X-Limit", strconv.FormatInt(limit, 10))
		resp, err := client.Do(req)
		if err != nil {
			count(func(s *stats) { s.Failed++ })
			return err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			count(func(s *stats) { s.Failed++ })
			return fmt.Errorf("the dependency answered %d", resp.StatusCode)
		}
		count(func(s *stats) { s.OK++ })
		return nil
	}
	// act counts a decision of the guard and returns how long to wait.
	act := func(err error, attempt *int) time.Duration {
		var ge *guard.Error
		if !errors.As(err, &ge) {
			count(func(s *stats) { s.Refused[err.Error()]++ })
			return 50 * time.Millisecond
		}
		pause := min(ge.After, 50*time.Millisecond)
		switch ge.Action {
		case guard.ActionDefer:
			reason := refusalReason(ge)
			if reason == "open" {
				observe("open")
			}
			count(func(s *stats) { s.Refused[reason]++ })
		case guard.ActionRetry:
			count(func(s *stats) { s.Retry++ })
			*attempt++
		case guard.ActionPark:
			count(func(s *stats) { s.Park++ })
			*attempt = 1
			pause = min(ge.After, 100*time.Millisecond)
		case guard.ActionDrop:
			count(func(s *stats) { s.Drop++ })
		}
		return pause
	}

	var wg sync.WaitGroup
	for range *threads {
		wg.Add(1)
		go func() {
			defer wg.Done()
			attempt := 1
			for ctx.Err() == nil {
				// The calls run to their end when the worker stops, so
				// that it leaves no lease behind by cutting one short.
				p, err := gd.Acquire(context.Background(), guard.Job{Attempt: attempt})
				if err == nil {
					observe("limit=" + strconv.FormatInt(p.Limit(), 10))
					err = p.Done(call(p.Context(), p.Limit()))
				}
				if err == nil {
					attempt = 1
					continue
				}
				select {
				case <-ctx.Done():
				case <-time.After(act(err, &attempt)):
				}
			}
		}()
	}
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	for ctx.Err() == nil {
		select {
		case <-ctx.Done():
		case <-tick.C:
			report()
		}
	}
	wg.Wait()
	gd.Close()
	report()
}

// refusalReason names why the guard deferred a job.
func refusalReason(ge *guard.Error) string {
	switch {
	case errors.Is(ge, protocol.ErrVersion):
		return "version"
	case errors.Is(ge.Reason, guard.ErrThrottled):
		return "slots"
	case errors.Is(ge.Reason, guard.ErrRateLimited):
		return "rate"
	case errors.Is(ge.Reason, guard.ErrOpen):
		return "open"
	case errors.Is(ge.Reason, guard.ErrRedisUnavailable):
		return "redis_unavailable"
	case errors.Is(ge.Reason, guard.ErrNoPolicy):
		return "no_policy"
	}
	return ge.Reason.Error()
}
