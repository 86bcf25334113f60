package faults

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/guard"
)

// The environment a worker process runs with; the Python worker (worker.py)
// reads the same variables.
const (
	roleEnv     = "SPILLWAY_FAULTS_ROLE" // "go-worker": TestMain plays a Go worker
	redisEnv    = "SPILLWAY_FAULTS_REDIS"
	depEnv      = "SPILLWAY_FAULTS_DEP"
	urlEnv      = "SPILLWAY_FAULTS_URL"
	threadsEnv  = "SPILLWAY_FAULTS_THREADS"
	leaseTTLEnv = "SPILLWAY_FAULTS_LEASE_TTL" // seconds, float
	batchEnv    = "SPILLWAY_FAULTS_BATCH"     // "true": batch mode
	// sentinelEnv lists the sentinels (comma-separated): the worker finds
	// the master through them, named masterEnv, instead of redisEnv.
	sentinelEnv = "SPILLWAY_FAULTS_SENTINELS"
	masterEnv   = "SPILLWAY_FAULTS_MASTER"
	statsPrefix = "faults-stats: "
)

// workerStats is what a worker prints, in either language, every 200 ms and
// once more when its stdin closes.
type workerStats struct {
	Lang    string         `json:"lang"`
	PID     int            `json:"pid"`
	OK      int64          `json:"ok"`
	Failed  int64          `json:"failed"`
	Drop    int64          `json:"drop"`
	Untyped int64          `json:"untyped"`
	Example string         `json:"example,omitempty"`
	Refused map[string]int `json:"refused"`
}

// goWorker takes jobs from the queue and runs each through the guard until
// it is done, as a job framework does: a refusal or a failure puts the job
// back after the guard's delay (capped at 200 ms so the campaign stays
// short); a drop is counted, and the job is left to the queue.
func goWorker() int {
	rdb := redis.NewClient(&redis.Options{Addr: os.Getenv(redisEnv), ContextTimeoutEnabled: true})
	if s := os.Getenv(sentinelEnv); s != "" {
		rdb = redis.NewFailoverClient(&redis.FailoverOptions{MasterName: os.Getenv(masterEnv),
			SentinelAddrs: strings.Split(s, ","), ContextTimeoutEnabled: true})
	}
	defer rdb.Close()
	ttl, _ := strconv.ParseFloat(os.Getenv(leaseTTLEnv), 64)
	opts := guard.Options{LeaseTTL: time.Duration(ttl * float64(time.Second))}
	lang := "go"
	if os.Getenv(batchEnv) == "true" {
		lang, opts.Batch = "go-batch", guard.BatchOptions{Enabled: true}
	}
	gd, err := guard.New(rdb, os.Getenv(depEnv), opts)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer gd.Close()
	n, _ := strconv.Atoi(os.Getenv(threadsEnv))
	url := os.Getenv(urlEnv)
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		cancel()
	}()
	client := &http.Client{Timeout: 30 * time.Second}

	var mu sync.Mutex
	st := workerStats{Lang: lang, PID: os.Getpid(), Refused: map[string]int{}}
	count := func(f func()) { mu.Lock(); f(); mu.Unlock() }
	report := func() {
		mu.Lock()
		b, _ := json.Marshal(st)
		mu.Unlock()
		fmt.Println(statsPrefix + string(b))
	}
	reasons := map[error]string{guard.ErrThrottled: "slots", guard.ErrRateLimited: "rate", guard.ErrOpen: "open",
		guard.ErrRedisUnavailable: "redis_unavailable", guard.ErrNoPolicy: "no_policy", guard.ErrLeaseLost: "lease_lost"}
	nextJob := func() (int64, bool) {
		resp, err := client.Get(url + "/job")
		if err != nil {
			return 0, false
		}
		defer resp.Body.Close()
		var j struct{ ID int64 }
		if resp.StatusCode != http.StatusOK || json.NewDecoder(resp.Body).Decode(&j) != nil {
			return 0, false
		}
		return j.ID, true
	}
	call := func(job int64) func(ctx context.Context) error {
		return func(ctx context.Context) error {
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, url+"/call?job="+strconv.FormatInt(job, 10), nil)
			if err != nil {
				return err
			}
			req.Header.Set("X-Lang", lang)
			resp, err := client.Do(req)
			if err != nil {
				count(func() { st.Failed++ })
				return err
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				count(func() { st.Failed++ })
				return fmt.Errorf("dependency answered %d", resp.StatusCode)
			}
			count(func() { st.OK++ })
			return nil
		}
	}
	sleep := func(d time.Duration) {
		select {
		case <-ctx.Done():
		case <-time.After(d):
		}
	}
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			for ctx.Err() == nil {
				job, ok := nextJob()
				if !ok {
					sleep(50 * time.Millisecond)
					continue
				}
				for attempt := 1; ctx.Err() == nil; {
					err := gd.Do(context.WithoutCancel(ctx), guard.Job{Attempt: attempt}, call(job))
					if err == nil {
						break
					}
					action, after, typed := guard.Decide(err)
					if !typed {
						count(func() {
							st.Untyped++
							if st.Example == "" {
								st.Example = err.Error()
							}
						})
						sleep(50 * time.Millisecond)
						continue
					}
					var ge *guard.Error
					if errors.As(err, &ge) && action == guard.ActionDefer {
						count(func() { st.Refused[reasons[ge.Reason]]++ })
					}
					switch action {
					case guard.ActionRetry:
						attempt++
					case guard.ActionPark:
						attempt = 1
					case guard.ActionDrop:
						count(func() { st.Drop++ })
					}
					if action == guard.ActionDrop {
						break
					}
					sleep(min(max(after, time.Millisecond), 200*time.Millisecond))
				}
			}
		})
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
	report()
	return 0
}
