package controllers

import (
	"context"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// gateSteps is a hook for the Evaluations store that holds one step of the
// gate, the first time it is reached, until the test lets it go.
type gateSteps struct {
	hold    string
	once    sync.Once
	reached chan struct{}
	release chan struct{}
	seen    chan string
}

func newGateSteps(hold string) *gateSteps {
	return &gateSteps{hold: hold, reached: make(chan struct{}), release: make(chan struct{}), seen: make(chan string, 100)}
}

func (h *gateSteps) hook(_ types.NamespacedName, step string) {
	h.seen <- step
	if step == h.hold {
		h.once.Do(func() {
			close(h.reached)
			<-h.release
		})
	}
}

// saw reports whether step was reached so far.
func (h *gateSteps) saw(step string) func() bool {
	var steps []string
	return func() bool {
		for {
			select {
			case s := <-h.seen:
				steps = append(steps, s)
			default:
				for _, s := range steps {
					if s == step {
						return true
					}
				}
				return false
			}
		}
	}
}

// TestReleaseIsNeverOverwritten interleaves one evaluation of a policy with
// its deletion's release, both ways, through a hook in the Evaluations store.
// Workers reported minCalls failures, so any evaluation that reads the
// state after the release would open the breaker: the release must be the
// last publish whatever the order, Closed at full capacity.
func TestReleaseIsNeverOverwritten(t *testing.T) {
	t.Parallel()
	t.Run("an evaluation planned before the deletion publishes after the release", func(t *testing.T) {
		t.Parallel()
		g := NewWithT(t)
		h := newGateSteps("evaluate")
		e, r, w, pol := gatedPolicy(t, g, h)

		// The evaluator got the policy before the deletion (or from a cache
		// that has not seen it yet) and is about to evaluate it.
		evaluated := reconcileInBackground(e, pol)
		g.Eventually(h.reached).Should(BeClosed())
		released := deleteAndRelease(t, g, r, pol)
		w.report(g, minCalls, protocol.Failure)
		close(h.release)
		g.Eventually(evaluated).Should(Receive(Succeed()))

		g.Expect(w.stateLimit()(g)).To(Equal("Closed/40"), "an evaluation published over the release")
		g.Expect(w.published(g).Epoch).To(Equal(released.Epoch))
	})

	t.Run("the deletion arrives during an evaluation", func(t *testing.T) {
		t.Parallel()
		g := NewWithT(t)
		h := newGateSteps("evaluating")
		e, r, w, pol := gatedPolicy(t, g, h)

		evaluated := reconcileInBackground(e, pol)
		g.Eventually(h.reached).Should(BeClosed())
		w.report(g, minCalls, protocol.Failure)
		g.Expect(env.Client.Delete(context.Background(), pol)).To(Succeed())
		deleting := getPolicy(g, pol.Namespace, pol.Name)
		deleted := make(chan error, 1)
		go func() {
			_, err := r.reconcileDelete(context.Background(), deleting, &observed{Deleting: true})
			deleted <- err
		}()
		g.Eventually(h.saw("release")).Should(BeTrue())
		g.Consistently(deleted).WithTimeout(300*time.Millisecond).ShouldNot(Receive(), "the release did not wait for the evaluation")
		close(h.release)
		g.Eventually(evaluated).Should(Receive(Succeed()))
		g.Eventually(deleted).Should(Receive(Succeed()))

		g.Expect(w.stateLimit()(g)).To(Equal("Closed/40"), "an evaluation published over the release")
		g.Expect(h.saw("releasing")()).To(BeTrue())
	})
}

// gatedPolicy creates a policy with its finalizer, evaluated once, and an
// evaluator and a reconciler outside any manager that share an Evaluations
// store hooked by h.
func gatedPolicy(t *testing.T, g Gomega, h *gateSteps) (*Evaluator, *PolicyReconciler, *worker, *spillwayv1alpha1.DependencyPolicy) {
	t.Helper()
	ctx := context.Background()
	ns := newNamespace(t)
	srv := redistest.Start(t)
	r := newCachedReconciler(t, ns, managerRedis(srv))
	e := &Evaluator{Client: env.Client, Redis: managerRedis(srv), Recorder: events.NewFakeRecorder(1000), Evaluations: r.Evaluations, Options: testOptions}
	e.setDefaults()
	w := newWorker(t, srv, ns, "ledger")
	pol := createPolicy(t, ns, "ledger", testSpec())
	controllerutil.AddFinalizer(pol, Finalizer)
	g.Expect(env.Client.Update(ctx, pol)).To(Succeed())
	g.Expect(<-reconcileInBackground(e, pol)).To(Succeed())
	g.Expect(w.stateLimit()(g)).To(Equal("Closed/40"))
	r.Evaluations.hook = h.hook
	return e, r, w, pol
}

// reconcileInBackground runs one evaluation of pol.
func reconcileInBackground(e *Evaluator, pol *spillwayv1alpha1.DependencyPolicy) chan error {
	done := make(chan error, 1)
	go func() {
		_, err := e.Reconcile(context.Background(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(pol)})
		done <- err
	}()
	return done
}

// deleteAndRelease deletes pol and runs its reconcileDelete to the end: the
// fleet released, the finalizer gone. It returns what the release published.
func deleteAndRelease(t *testing.T, g Gomega, r *PolicyReconciler, pol *spillwayv1alpha1.DependencyPolicy) protocol.Published {
	t.Helper()
	ctx := context.Background()
	g.Expect(env.Client.Delete(ctx, pol)).To(Succeed())
	deleting := getPolicy(g, pol.Namespace, pol.Name)
	_, err := r.reconcileDelete(ctx, deleting, &observed{Deleting: true})
	g.Expect(err).NotTo(HaveOccurred())
	err = env.Client.Get(ctx, client.ObjectKeyFromObject(pol), &spillwayv1alpha1.DependencyPolicy{})
	g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "the finalizer went")
	c, err := protocol.NewClient(r.Redis, protocol.Dependency{Namespace: pol.Namespace, Name: pol.Name})
	g.Expect(err).NotTo(HaveOccurred())
	p, found, err := c.ReadPublished(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(found).To(BeTrue())
	g.Expect(p.State).To(BeEquivalentTo("Closed"))
	return p
}
