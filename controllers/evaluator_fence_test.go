package controllers

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/redis/go-redis/v9"
	"k8s.io/apimachinery/pkg/types"

	"github.com/spillway-dev/spillway/internal/redistest"
)

// publishHook is a go-redis hook on a manager's Redis client that can hold
// the manager's next publish until the test lets it go, and records what
// Redis answered to each publish.
type publishHook struct {
	armed    atomic.Bool
	reached  chan struct{}
	release  chan struct{}
	attempts atomic.Int64

	mu      sync.Mutex
	replies []string
}

func newPublishHook() *publishHook {
	return &publishHook{reached: make(chan struct{}), release: make(chan struct{})}
}

// isPublish tells the publish script's EVALSHA (or EVAL) by a field only it
// writes.
func isPublish(cmd redis.Cmder) bool {
	return (cmd.Name() == "evalsha" || cmd.Name() == "eval") && slices.Contains(cmd.Args(), any("ctrl_ramp_step"))
}

func (h *publishHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *publishHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (h *publishHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if !isPublish(cmd) {
			return next(ctx, cmd)
		}
		h.attempts.Add(1)
		if h.armed.CompareAndSwap(true, false) {
			close(h.reached)
			<-h.release
		}
		err := next(ctx, cmd)
		reply := "error: " + errString(err)
		if c, ok := cmd.(*redis.Cmd); ok && err == nil {
			if res, err := c.Slice(); err == nil && len(res) > 0 {
				reply = map[int64]string{1: "written"}[res[0].(int64)]
				if reply == "" {
					reply = "refused"
				}
			}
		}
		h.mu.Lock()
		h.replies = append(h.replies, reply)
		h.mu.Unlock()
		return err
	}
}

func errString(err error) string {
	if err == nil {
		return "none"
	}
	return err.Error()
}

// lastReply is Redis's answer to the last publish: written, refused or an
// error.
func (h *publishHook) lastReply() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.replies) == 0 {
		return ""
	}
	return h.replies[len(h.replies)-1]
}

// reply is Redis's answer to the i-th publish (from 0), "" until it came.
func (h *publishHook) reply(i int) func() string {
	return func() string {
		h.mu.Lock()
		defer h.mu.Unlock()
		if i >= len(h.replies) {
			return ""
		}
		return h.replies[i]
	}
}

// TestEvaluatorFencedPublish runs two managers on one policy, as when a
// deposed leader is still inside its lease. Manager A reads the state and
// plans; its publish is held while manager B reads, plans and publishes at
// the same epoch. When A's publish reaches Redis it must be refused, not
// overwrite B's newer decision; A then reports StaleEpoch, re-reads at its
// next evaluation (after at least one interval, not in a hot loop) and
// publishes again.
func TestEvaluatorFencedPublish(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ns := newNamespace(t)
	srv := redistest.Start(t)
	w := newWorker(t, srv, ns, "search")

	hook := newPublishHook()
	rdbA := managerRedis(srv)
	rdbA.AddHook(hook)
	optsA := testOptions
	optsA.RedisTimeout = 10 * time.Second // the held publish must not time out
	a := &Evaluator{Redis: rdbA, Options: optsA}
	startReconciler(t, env.Config, ns, a, &PolicyReconciler{Redis: rdbA, Options: optsA})
	rdbB := managerRedis(srv)
	startReconciler(t, env.Config, ns, &Evaluator{Redis: rdbB, Options: testOptions}, &PolicyReconciler{Redis: rdbB, Options: testOptions})
	createPolicy(t, ns, "search", testSpec())
	key := types.NamespacedName{Namespace: ns, Name: "search"}
	g.Eventually(w.stateLimit()).Should(Equal("Closed/40"))
	g.Eventually(hook.lastReply).Should(Equal("written"))

	// A reads and plans; its publish is held.
	hook.armed.Store(true)
	g.Eventually(hook.reached).Should(BeClosed())
	hook.mu.Lock()
	heldReply := len(hook.replies)
	hook.mu.Unlock()
	held := w.published(g)
	// B reads after A did, and publishes.
	g.Eventually(func(g Gomega) time.Time { return w.published(g).UpdatedAt }).
		WithPolling(5 * time.Millisecond).ShouldNot(Equal(held.UpdatedAt))
	bWrote := w.published(g)
	// A's publish arrives late.
	close(hook.release)
	g.Eventually(hook.reply(heldReply)).ShouldNot(BeEmpty())
	g.Expect(hook.reply(heldReply)()).To(Equal("refused"), "A's publish, planned before B's newer one, was accepted over it")
	g.Expect(w.published(g).UpdatedAt).NotTo(BeTemporally("<", bWrote.UpdatedAt))

	// A reports the refusal, then recovers from what Redis holds, without
	// retrying in a hot loop.
	g.Eventually(func() string {
		ev, _ := a.Evaluations.lastEvaluation(key)
		return evalReason(ev.Err)
	}).WithPolling(5 * time.Millisecond).Should(Equal(ReasonStaleEpoch))
	refused := hook.attempts.Load()
	g.Eventually(func() error {
		ev, _ := a.Evaluations.lastEvaluation(key)
		return ev.Err
	}).Should(Succeed(), "A publishes again after re-reading")
	g.Expect(hook.lastReply()).To(Equal("written"))
	time.Sleep(time.Second)
	g.Expect(hook.attempts.Load()-refused).To(BeNumerically("<=", int64(time.Second/interval)+2),
		"A publishes about once per interval after a refusal")
	g.Expect(w.stateLimit()(g)).To(Equal("Closed/40"))
}
