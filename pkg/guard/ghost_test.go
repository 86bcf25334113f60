package guard_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// ghostBound is the target: an acquisition whose reply was never read
// holds its slot for at most this long after Redis answers again.
const ghostBound = 2 * time.Second

// debugServer starts a redis-server that accepts DEBUG SLEEP, which the
// ghost tests use to make Redis answer late.
func debugServer(t *testing.T) *redistest.Server {
	return redistest.Start(t, redistest.WithArgs("--enable-debug-command", "yes"))
}

// stall blocks Redis for d with DEBUG SLEEP on a connection of its own and
// returns a channel closed once Redis has answered it, i.e. once Redis
// answers again. It waits until the sleep has surely started.
func stall(t *testing.T, srv *redistest.Server, d time.Duration) <-chan struct{} {
	t.Helper()
	other := srv.Client(func(o *redis.Options) { o.MaxRetries = -1 })
	if err := other.Ping(t.Context()).Err(); err != nil {
		t.Fatalf("ping: %v", err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		ctx, cancel := context.WithTimeout(context.Background(), d+10*time.Second)
		defer cancel()
		if err := other.Do(ctx, "DEBUG", "SLEEP", fmt.Sprintf("%.3f", d.Seconds())).Err(); err != nil {
			t.Errorf("debug sleep: %v", err)
		}
	}()
	time.Sleep(min(d/4, 100*time.Millisecond)) // the DEBUG SLEEP reaches Redis first
	return done
}

// admittedWithin polls gd until it has admitted n calls at once (it holds
// them) and returns how long that took from since. It fails the test if
// that takes longer than bound.
func admittedWithin(t *testing.T, gd *guard.Guard, n int, since time.Time, bound time.Duration) time.Duration {
	t.Helper()
	var held []*guard.Permit
	defer func() {
		for _, p := range held {
			_ = p.Done(nil)
		}
	}()
	var last error
	for len(held) < n && time.Since(since) < bound+time.Second {
		p, err := gd.Acquire(t.Context(), guard.Job{})
		if err != nil {
			last = err
			time.Sleep(10 * time.Millisecond)
			continue
		}
		held = append(held, p)
	}
	took := time.Since(since)
	if len(held) < n {
		t.Fatalf("only %d of %d slots admitted %v after Redis answered again (bound %v); last refusal: %v", len(held), n, took.Round(time.Millisecond), bound, last)
	}
	if took > bound {
		t.Errorf("all %d slots admitted only %v after Redis answered again, want at most %v", n, took.Round(time.Millisecond), bound)
	}
	return took
}

// An acquisition queued behind a slow command times out in the client but
// runs in Redis afterwards; its lease must not hold the only slot for the
// lease TTL. The request carries a deadline and Redis refuses it: once the
// guard has seen a reply, from its estimate of Redis's clock; for the very
// first request, from the local wall clock.
func TestAcquireThatTimedOutBehindASlowCommandLeavesNoGhost(t *testing.T) {
	for _, warm := range []bool{true, false} {
		t.Run(map[bool]string{true: "estimated deadline", false: "first request"}[warm], func(t *testing.T) {
			g := NewWithT(t)
			srv := debugServer(t)
			rdb := fastClient(srv)
			publish(t, rdb, defaultPublished(1))
			reg := prometheus.NewRegistry()
			gd := newGuard(t, rdb, guard.Options{Registerer: reg})
			if warm {
				g.Expect(gd.Do(t.Context(), guard.Job{}, ok)).To(Succeed(), "clock sampled")
			} else {
				// Another worker loads the scripts: the stalled request
				// must find them, or it would fail with NOSCRIPT and write
				// nothing.
				g.Expect(newGuard(t, rdb, guard.Options{}).Do(t.Context(), guard.Job{}, ok)).To(Succeed())
			}

			answered := stall(t, srv, time.Second)
			err := gd.Do(t.Context(), guard.Job{}, ok)
			wantDecision(t, err, guard.ActionDefer, guard.ErrRedisUnavailable)
			<-answered
			took := admittedWithin(t, gd, 1, time.Now(), ghostBound)
			t.Logf("slot free again %v after Redis answered (DEBUG SLEEP 1s)", took.Round(time.Millisecond))
			g.Expect(testutil.ToFloat64(counter(t, reg, "spillway_worker_unread_leases_total", "result", "queued"))).To(Equal(1.0))
			g.Eventually(func() float64 {
				return testutil.ToFloat64(counter(t, reg, "spillway_worker_unread_leases_total", "result", "forgotten"))
			}).Should(Equal(1.0))
		})
	}
}

// A caller that gives up on a stalled acquisition gets its own cancellation
// back, the guard counts no Redis error, and no ghost lease is left: whether
// the reply comes after RedisTimeout (never read) or before it (read after
// the cancel, and the slot given back at once).
func TestAcquireCancelledWhileStalledLeavesNoGhost(t *testing.T) {
	for _, timeout := range []time.Duration{300 * time.Millisecond, 3 * time.Second} {
		t.Run("RedisTimeout="+timeout.String(), func(t *testing.T) {
			g := NewWithT(t)
			srv := debugServer(t)
			rdb := fastClient(srv)
			publish(t, rdb, defaultPublished(1))
			reg := prometheus.NewRegistry()
			// RedisTimeout well past the cancel, so that the cancel ends the wait.
			gd := newGuard(t, rdb, guard.Options{RedisTimeout: timeout, Registerer: reg})
			g.Expect(gd.Do(t.Context(), guard.Job{}, ok)).To(Succeed())

			answered := stall(t, srv, time.Second)
			ctx, cancel := context.WithCancel(t.Context())
			time.AfterFunc(20*time.Millisecond, cancel)
			called := false
			err := gd.Do(ctx, guard.Job{}, func(context.Context) error { called = true; return nil })
			if !errors.Is(err, context.Canceled) || errors.Is(err, guard.ErrRedisUnavailable) {
				t.Errorf("cancelled acquisition returned %v, want the caller's context.Canceled", err)
			}
			if called {
				t.Errorf("the function ran after its caller cancelled")
			}
			if n := testutil.ToFloat64(counter(t, reg, "spillway_worker_redis_errors_total")); n != 0 {
				t.Errorf("a cancelled acquisition counted %v Redis errors, want 0", n)
			}
			<-answered
			took := admittedWithin(t, gd, 1, time.Now(), ghostBound)
			t.Logf("slot free again %v after Redis answered (cancelled 20ms into the stall)", took.Round(time.Millisecond))
			w := window(t, rdb)
			g.Expect(w.Calls).To(Equal(int64(2)), "the warm-up and the probe count; the cancelled call does not")
			g.Expect(w.Failures + w.Timeouts).To(BeZero())
		})
	}
}

// slowReplies is a TCP proxy in front of Redis that can hold Redis's replies
// back while passing requests on at once: a worker whose replies arrive late
// (a starved process, a slow network) although Redis ran its requests in time.
// It can also lose requests, as a broken connection does.
type slowReplies struct {
	ln    net.Listener
	delay atomic.Int64 // nanoseconds each reply chunk is held back
	drop  atomic.Bool  // requests are discarded
}

func newSlowReplies(t *testing.T, target string) *slowReplies {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &slowReplies{ln: ln}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			server, err := net.Dial("tcp", target)
			if err != nil {
				_ = client.Close()
				continue
			}
			go func() {
				defer func() { _ = server.Close() }()
				buf := make([]byte, 64<<10)
				for {
					n, err := client.Read(buf)
					if err != nil {
						return
					}
					if p.drop.Load() {
						continue
					}
					if _, err := server.Write(buf[:n]); err != nil {
						return
					}
				}
			}()
			go func() {
				defer func() { _ = client.Close() }()
				buf := make([]byte, 64<<10)
				for {
					n, err := server.Read(buf)
					if err != nil {
						return
					}
					time.Sleep(time.Duration(p.delay.Load()))
					if _, err := client.Write(buf[:n]); err != nil {
						return
					}
				}
			}()
		}
	}()
	return p
}

// Redis runs an acquisition in time but its reply arrives after RedisTimeout:
// the lease exists though no call holds it, and only the forgetter can
// remove it.
func TestAcquireWhoseReplyArrivedLateLeavesNoGhost(t *testing.T) {
	g := NewWithT(t)
	srv := redistest.Start(t)
	direct := fastClient(srv)
	publish(t, direct, defaultPublished(1))
	proxy := newSlowReplies(t, srv.Addr())
	viaProxy := redis.NewClient(&redis.Options{Addr: proxy.ln.Addr().String(), ContextTimeoutEnabled: true, MaxRetries: -1})
	t.Cleanup(func() { _ = viaProxy.Close() })
	reg := prometheus.NewRegistry()
	slow := newGuard(t, viaProxy, guard.Options{Registerer: reg})
	g.Expect(slow.Do(t.Context(), guard.Job{}, ok)).To(Succeed(), "clock sampled")

	proxy.delay.Store(int64(600 * time.Millisecond))
	err := slow.Do(t.Context(), guard.Job{}, ok)
	wantDecision(t, err, guard.ActionDefer, guard.ErrRedisUnavailable)
	held := direct.ZCount(t.Context(), protocol.KeysFor(slow.Dependency()).Leases, "(0", "+inf").Val()
	proxy.delay.Store(0)
	answered := time.Now()
	g.Expect(held).To(BeNumerically("<=", 1))
	took := admittedWithin(t, newGuard(t, direct, guard.Options{}), 1, answered, ghostBound)
	t.Logf("slot free again %v after replies came through again (reply held back 600ms; lease seen in Redis: %d)", took.Round(time.Millisecond), held)
	g.Eventually(func() float64 {
		return testutil.ToFloat64(counter(t, reg, "spillway_worker_unread_leases_total", "result", "forgotten"))
	}).Should(BeNumerically(">=", 1))
}

// A fleet of goroutines keeps calling while redis-server is frozen with
// SIGSTOP: their acquisitions and releases queue in its sockets and run on
// SIGCONT. Within the bound after that, every slot can be taken again.
func TestPausedRedisLeavesNoGhostsUnderAFleet(t *testing.T) {
	inModes(t, func(t *testing.T, batch guard.BatchOptions) {
		pauses := []time.Duration{time.Second, 5 * time.Second}
		if batch.Enabled {
			// A pool's requests queue and run as per-call ones do; the
			// longer pause adds 5 s to the suite and nothing to the proof.
			pauses = pauses[:1]
		}
		for _, pause := range pauses {
			t.Run(pause.String(), func(t *testing.T) {
				g := NewWithT(t)
				srv := redistest.Start(t)
				rdb := fastClient(srv)
				const limit, goroutines = 4, 32
				publish(t, rdb, defaultPublished(limit))
				gd := newGuard(t, rdb, guard.Options{Batch: batch})

				ctx, stop := context.WithCancel(t.Context())
				var wg sync.WaitGroup
				var calls sync.Map
				for i := range goroutines {
					wg.Go(func() {
						for ctx.Err() == nil {
							err := gd.Do(ctx, guard.Job{}, func(context.Context) error {
								calls.Store(i, true)
								time.Sleep(2 * time.Millisecond)
								return nil
							})
							if _, after, decided := guard.Decide(err); decided {
								sleepCtx(ctx, min(after, 20*time.Millisecond))
							}
						}
					})
				}
				// The fleet is calling before the pause: on a busy machine the
				// goroutines can take well over 300 ms to get going.
				called := func() (n int) { calls.Range(func(any, any) bool { n++; return true }); return }
				g.Eventually(called, 20*time.Second, 10*time.Millisecond).Should(BeNumerically(">", limit), "the fleet was calling before the pause")
				g.Expect(srv.Pause()).To(Succeed())
				time.Sleep(pause)
				stop()
				g.Expect(srv.Resume()).To(Succeed())
				resumed := time.Now()
				wg.Wait()

				// A batching pool's own idle slots would be free to itself:
				// another process must get every slot, so none is a ghost
				// and the pool gives back what it holds.
				checker := gd
				if batch.Enabled {
					checker = newGuard(t, rdb, guard.Options{})
				}
				took := admittedWithin(t, checker, limit, resumed, ghostBound)
				t.Logf("all %d slots free again %v after SIGCONT (SIGSTOP %v)", limit, took.Round(time.Millisecond), pause)
			})
		}
	})
}

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

// lateOnce makes the first acquisition it sees carry a deadline long past, as
// if Redis's clock had jumped ahead of the guard's estimate (a failover to a
// master with another clock).
type lateOnce struct{ done *atomic.Bool }

func (h lateOnce) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h lateOnce) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		// The first command after the hook is added is an acquisition:
		// EVALSHA sha numkeys keys... lease-id ttl deadline ...
		if args := cmd.Args(); args[0] == "evalsha" && h.done.CompareAndSwap(false, true) {
			args[3+args[2].(int)+2] = int64(1)
		}
		return next(ctx, cmd)
	}
}
func (h lateOnce) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// A request refused as late although its reply came in time is made once
// more with a fresh estimate of Redis's clock, and admitted.
func TestLateRefusalInTimeRetriesOnce(t *testing.T) {
	g := NewWithT(t)
	rdb := fastClient(redistest.Start(t))
	publish(t, rdb, defaultPublished(1))
	gd := newGuard(t, rdb, guard.Options{})
	g.Expect(gd.Do(t.Context(), guard.Job{}, ok)).To(Succeed(), "clock sampled")
	registered(t, rdb, gd)

	var late atomic.Bool
	rdb.AddHook(lateOnce{&late})
	g.Expect(rdb.ConfigResetStat(t.Context()).Err()).To(Succeed())
	g.Expect(gd.Do(t.Context(), guard.Job{}, ok)).To(Succeed())
	g.Expect(late.Load()).To(BeTrue(), "the first acquisition was sent with a past deadline")
	g.Expect(commandCalls(t, rdb)["evalsha"]).To(Equal(3), "refused as late, acquired again, released")
	g.Expect(gd.Do(t.Context(), guard.Job{}, ok)).To(Succeed(), "the slot was released")
}

// A release lost on the way to Redis leaves the lease held; the forgetter
// frees it once requests get through again, not the lease TTL later.
func TestReleaseThatNeverReachedRedisLeavesNoGhost(t *testing.T) {
	g := NewWithT(t)
	srv := redistest.Start(t)
	direct := fastClient(srv)
	publish(t, direct, defaultPublished(1))
	proxy := newSlowReplies(t, srv.Addr())
	viaProxy := redis.NewClient(&redis.Options{Addr: proxy.ln.Addr().String(), ContextTimeoutEnabled: true, MaxRetries: -1})
	t.Cleanup(func() { _ = viaProxy.Close() })
	slow := newGuard(t, viaProxy, guard.Options{})

	p, err := slow.Acquire(t.Context(), guard.Job{})
	g.Expect(err).NotTo(HaveOccurred())
	proxy.drop.Store(true)
	g.Expect(p.Done(nil)).To(Succeed())
	g.Expect(direct.ZCount(t.Context(), protocol.KeysFor(slow.Dependency()).Leases, "(0", "+inf").Val()).
		To(Equal(int64(1)), "the release was lost: the lease is still held")
	proxy.drop.Store(false)
	took := admittedWithin(t, newGuard(t, direct, guard.Options{}), 1, time.Now(), ghostBound)
	t.Logf("slot free again %v after requests got through again (release lost)", took.Round(time.Millisecond))
}
