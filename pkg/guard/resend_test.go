package guard_test

import (
	"bytes"
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// lostReplies is a TCP proxy in front of Redis that passes a command on to
// Redis and then, instead of passing Redis's reply back, closes the client's
// connection: the reply of a command Redis ran is lost, as with a proxy
// reset, CLIENT KILL or a NAT timeout. The client library (go-redis with its
// default MaxRetries) then resends the same command on a new connection.
// Only the first run of each distinct command carrying the armed script's
// SHA loses its reply, up to a count; its resend gets through.
type lostReplies struct {
	ln   net.Listener
	lost atomic.Int64 // replies lost so far

	mu     sync.Mutex
	sha    []byte
	budget int
	seen   map[string]bool
}

func newLostReplies(t *testing.T, target string) *lostReplies {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &lostReplies{ln: ln, seen: map[string]bool{}}
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
			go p.serve(client, server)
		}
	}()
	return p
}

func (p *lostReplies) addr() string { return p.ln.Addr().String() }

// lose arms the proxy: the first run of each of the next n distinct commands
// that carry the SHA of the protocol script name loses its reply (n = 0
// disarms it). n below 0: every command that carries it loses its reply,
// resends of the same bytes too, until lose is called again (a pool that
// resends at once after a lost reply sends the same deadline, to the
// millisecond: the resend would get through).
func (p *lostReplies) lose(t *testing.T, name string, n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.sha, p.budget = []byte(scriptSHA(t, name)), n
}

// doomed reports whether the reply to the request req is to be lost.
func (p *lostReplies) doomed(req []byte) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.budget == 0 || !bytes.Contains(req, p.sha) || (p.budget > 0 && p.seen[string(req)]) {
		return false
	}
	p.seen[string(req)] = true
	if p.budget > 0 { // below 0: every one until the next lose
		p.budget--
	}
	return true
}

func (p *lostReplies) serve(client, server net.Conn) {
	var doomed atomic.Bool // the reply now on its way is to be lost
	go func() {
		defer func() { _ = server.Close() }()
		buf := make([]byte, 64<<10)
		for {
			n, err := client.Read(buf)
			if err != nil {
				return
			}
			if p.doomed(buf[:n]) {
				doomed.Store(true)
			}
			if _, err := server.Write(buf[:n]); err != nil {
				return
			}
		}
	}()
	defer func() { _ = client.Close() }()
	buf := make([]byte, 64<<10)
	for {
		n, err := server.Read(buf)
		if err != nil {
			return
		}
		if doomed.Load() {
			// Redis ran the command: its reply is here. Drop it and the
			// connection.
			p.lost.Add(1)
			_ = server.Close()
			return
		}
		if _, err := client.Write(buf[:n]); err != nil {
			return
		}
	}
}

// scriptSHA is the SHA1 go-redis sends with EVALSHA for a protocol script
// (lib.lua then the script, as pkg/protocol builds it).
func scriptSHA(t *testing.T, name string) string {
	t.Helper()
	lib, err := os.ReadFile("../protocol/lua/lib.lua")
	if err != nil {
		t.Fatal(err)
	}
	body, err := os.ReadFile("../protocol/lua/" + name + ".lua")
	if err != nil {
		t.Fatal(err)
	}
	sum := sha1.Sum(append(lib, body...))
	return hex.EncodeToString(sum[:])
}

// readmeClient is the client the README builds: go-redis's default
// MaxRetries (3) resends a command whose reply was lost.
func readmeClient(t *testing.T, addr string) *redis.Client {
	rdb := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = rdb.Close() })
	return rdb
}

// liveLeases counts the leases that hold a slot now, by Redis time.
func liveLeases(t *testing.T, rdb redis.UniversalClient, gd *guard.Guard) int64 {
	t.Helper()
	now, err := rdb.Time(t.Context()).Result()
	if err != nil {
		t.Fatal(err)
	}
	n, err := rdb.ZCount(t.Context(), protocol.KeysFor(gd.Dependency()).Leases,
		"("+strconv.FormatInt(now.UnixMilli(), 10), "+inf").Result()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// resendSetup starts Redis with a policy of the given limit, loads the
// scripts (so that go-redis sends EVALSHA, which the proxy recognises), and
// returns a direct client and a guard on the README's client behind the
// proxy.
func resendSetup(t *testing.T, limit int64) (*redis.Client, *lostReplies, *guard.Guard) {
	t.Helper()
	srv := redistest.Start(t)
	direct := fastClient(srv)
	publish(t, direct, defaultPublished(limit))
	if err := newGuard(t, direct, guard.Options{}).Do(t.Context(), guard.Job{}, ok); err != nil {
		t.Fatalf("loading the scripts: %v", err)
	}
	proxy := newLostReplies(t, srv.Addr())
	return direct, proxy, newGuard(t, readmeClient(t, proxy.addr()), guard.Options{})
}

// An acquisition Redis ran whose reply was lost is resent by go-redis with
// the same lease id. At limit 1 the resend finds the slot held by its own
// lease: it must answer admitted, as the first run did, not Throttled, which
// left the lease held by no call for the whole LeaseTTL.
func TestAcquireWhoseReplyWasLostIsAdmittedOnResend(t *testing.T) {
	g := NewWithT(t)
	direct, proxy, gd := resendSetup(t, 1)

	proxy.lose(t, "acquire", 1)
	err := gd.Do(t.Context(), guard.Job{}, ok)
	g.Expect(proxy.lost.Load()).To(Equal(int64(1)), "the proxy lost no acquire reply")
	time.Sleep(time.Second)
	g.Expect(liveLeases(t, direct, gd)).To(BeZero(), "a lease is held by no call 1s after the resend")
	g.Expect(err).NotTo(HaveOccurred(), "the resend was not admitted")
	g.Expect(newGuard(t, direct, guard.Options{}).Do(t.Context(), guard.Job{}, ok)).To(Succeed())
}

// A release Redis ran whose reply was lost is resent: its outcome counts once.
// Five failing calls, each release reply lost once, add exactly five failures
// (and five first attempts) to the window.
func TestReleaseWhoseReplyWasLostCountsOnce(t *testing.T) {
	g := NewWithT(t)
	direct, proxy, gd := resendSetup(t, 1)
	before := window(t, direct)

	proxy.lose(t, "release", 5)
	failing := errors.New("dependency failed")
	for range 5 {
		err := gd.Do(t.Context(), guard.Job{Attempt: 1}, func(ctx context.Context) error { return failing })
		g.Expect(errors.Is(err, failing)).To(BeTrue(), "Do = %v, want the call's failure", err)
	}
	g.Expect(proxy.lost.Load()).To(Equal(int64(5)), "the proxy did not lose five release replies")
	after := window(t, direct)
	g.Expect(after.Failures-before.Failures).To(Equal(int64(5)), "failures added by five calls")
	g.Expect(after.Calls-before.Calls).To(Equal(int64(5)), "calls added by five calls")
	g.Expect(after.ByAttempt[0]-before.ByAttempt[0]).To(Equal(int64(5)), "first attempts added by five calls")
	g.Expect(liveLeases(t, direct, gd)).To(BeZero())
}
