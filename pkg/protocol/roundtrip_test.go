package protocol_test

import (
	"context"
	"net"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/protocol"
)

// wireHook records every command a client puts on the wire and every dial.
type wireHook struct {
	mu    sync.Mutex
	cmds  []string
	dials int
}

func (h *wireHook) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		h.mu.Lock()
		h.dials++
		h.mu.Unlock()
		return next(ctx, network, addr)
	}
}

func (h *wireHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.mu.Lock()
		h.cmds = append(h.cmds, cmd.FullName())
		h.mu.Unlock()
		return next(ctx, cmd)
	}
}

func (h *wireHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.mu.Lock()
		for _, c := range cmds {
			h.cmds = append(h.cmds, "pipelined "+c.FullName())
		}
		h.mu.Unlock()
		return next(ctx, cmds)
	}
}

func (h *wireHook) take() (cmds []string, dials int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	cmds, dials = h.cmds, h.dials
	h.cmds, h.dials = nil, 0
	return cmds, dials
}

var cmdstatLine = regexp.MustCompile(`^cmdstat_([^:]+):calls=(\d+),`)

// commandCalls parses INFO commandstats into command → calls. The INFO that
// produces the reply is not counted in it.
func commandCalls(t *testing.T, admin *redis.Client) map[string]int64 {
	t.Helper()
	info, err := admin.Info(ctxT(t), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int64{}
	for line := range strings.Lines(info) {
		if m := cmdstatLine.FindStringSubmatch(strings.TrimSpace(line)); m != nil {
			n, _ := strconv.ParseInt(m[2], 10, 64)
			out[m[1]] = n
		}
	}
	return out
}

var redisCall = regexp.MustCompile(`redis\.call\('([A-Za-z]+)'`)

// scriptCommands counts the redis.call sites per command in lib.lua plus the
// named script: an upper bound on what one run issues inside the server.
func scriptCommands(t *testing.T, name string) map[string]int64 {
	t.Helper()
	out := map[string]int64{}
	for _, f := range []string{"lua/lib.lua", "lua/" + name + ".lua"} {
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range redisCall.FindAllStringSubmatch(string(src), -1) {
			out[strings.ToLower(m[1])]++
		}
	}
	return out
}

// TestOneRoundTrip: an acquisition is one EVALSHA, and so is a release with
// its report, once the scripts are loaded. Checked on the client (a hook on
// every connection-level client sees every command sent and every dial) and
// on the server (INFO commandstats of the master that owns the dependency).
// Not parallel: no other test may run commands meanwhile.
func TestOneRoundTrip(t *testing.T) {
	type setup struct {
		rdb   redis.UniversalClient
		owner *redis.Client   // admin client of the dependency's master
		other []*redis.Client // admin clients of the other masters
	}
	for _, topo := range []string{"standalone", "cluster"} {
		t.Run(topo, func(t *testing.T) {
			hook := &wireHook{}
			var s setup
			dep := newDep(t)
			if topo == "standalone" {
				srv, _ := sharedStandalone(t)
				rdb := srv.Client(func(o *redis.Options) { o.PoolSize = 1 })
				rdb.AddHook(hook)
				s = setup{rdb: rdb, owner: srv.Client()}
			} else {
				cl, _ := sharedCluster(t)
				rdb := cl.Client(func(o *redis.ClusterOptions) { o.PoolSize = 1 })
				rdb.OnNewNode(func(c *redis.Client) { c.AddHook(hook) })
				owner := keySlot(protocol.KeysFor(dep).State) * len(cl.Nodes()) / 16384
				for i, n := range cl.Nodes() {
					if i == owner {
						s.owner = n.Client()
					} else {
						s.other = append(s.other, n.Client())
					}
				}
				s.rdb = rdb
			}
			c, err := protocol.NewClient(s.rdb, dep)
			if err != nil {
				t.Fatal(err)
			}
			ctx := ctxT(t)
			const n = 25
			mustPublish(t, c, policy(n))
			// Warm-up: connections made, scripts loaded (EVALSHA, NOSCRIPT, EVAL).
			mustRelease(t, c, mustAdmit(t, c, time.Minute), protocol.Success, 1)
			hook.take()

			resetStats := func() {
				for _, a := range append([]*redis.Client{s.owner}, s.other...) {
					if err := a.ConfigResetStat(ctx).Err(); err != nil {
						t.Fatal(err)
					}
				}
			}
			check := func(phase, script string) {
				t.Helper()
				cmds, dials := hook.take()
				if dials != 0 {
					t.Errorf("%s: %d dials after the warm-up", phase, dials)
				}
				if len(cmds) != n {
					t.Errorf("%s: %d commands on the wire for %d calls, want %d: %v", phase, len(cmds), n, n, cmds)
				}
				for _, name := range cmds {
					if name != "evalsha" {
						t.Errorf("%s: client sent %q, want only evalsha", phase, name)
					}
				}
				stats := commandCalls(t, s.owner)
				t.Logf("%s: client sent %d commands; server commandstats %v", phase, len(cmds), stats)
				if stats["evalsha"] != n {
					t.Errorf("%s: server counted %d evalsha, want %d", phase, stats["evalsha"], n)
				}
				inside := scriptCommands(t, script)
				for name, calls := range stats {
					switch {
					case name == "evalsha", name == "config|resetstat", name == "info":
					case inside[name] > 0:
						// Issued by the script itself: Redis counts commands
						// run by scripts in commandstats too.
						if calls > n*inside[name] {
							t.Errorf("%s: server counted %d %s, more than %d runs of %s.lua can issue", phase, calls, name, n, script)
						}
					default:
						t.Errorf("%s: server counted %d calls of %s, which neither the client nor %s.lua sends", phase, calls, name, script)
					}
				}
				for i, a := range s.other {
					if got := commandCalls(t, a)["evalsha"]; got != 0 {
						t.Errorf("%s: another master (%d) ran %d evalsha", phase, i, got)
					}
				}
			}

			resetStats()
			held := make([]protocol.Admission, 0, n)
			for range n {
				held = append(held, mustAdmit(t, c, time.Minute))
			}
			check("acquire", "acquire")

			resetStats()
			for i, a := range held {
				mustRelease(t, c, a, protocol.Outcome("sft"[i%3:i%3+1]), 1+i%5)
			}
			check("release", "release")
		})
	}
}
