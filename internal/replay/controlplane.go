package replay

import (
	"context"
	"errors"
	"fmt"
	"time"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	"github.com/redis/go-redis/v9"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/controllers"
	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/internal/testenv"
	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// ControlPlane is everything the protected fleet runs against, on loopback:
// kube-apiserver and etcd (envtest) with the Spillway and KEDA CRDs, a
// redis-server, and the manager running the DependencyPolicy reconciler.
type ControlPlane struct {
	Env   *testenv.Env
	Redis *redistest.Server
	RDB   *redis.Client

	stopManager context.CancelFunc
	managerDone chan error
}

// StartControlPlane starts the control plane; the controller evaluates each
// policy every interval. Call Stop to tear it all down.
func StartControlPlane(ctx context.Context, interval time.Duration) (*ControlPlane, error) {
	env, err := testenv.Start()
	if err != nil {
		return nil, err
	}
	cp := &ControlPlane{Env: env}
	cp.Redis, err = redistest.StartServer()
	if err != nil {
		cp.Stop()
		return nil, err
	}
	cp.RDB = cp.Redis.Client(func(o *redis.Options) {
		o.ContextTimeoutEnabled = true
		o.PoolSize = 256
	})
	mgr, err := ctrl.NewManager(env.Config, ctrl.Options{
		Scheme:                 env.Scheme,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Controller:             config.Controller{SkipNameValidation: ptr(true)},
	})
	if err != nil {
		cp.Stop()
		return nil, fmt.Errorf("failed to create the manager: %w", err)
	}
	mctx, cancel := context.WithCancel(ctx)
	opts := controllers.Options{EvaluationInterval: interval, StatusInterval: time.Second}
	evaluations := controllers.NewEvaluations()
	if err := (&controllers.Evaluator{Redis: cp.RDB, Evaluations: evaluations, Options: opts}).SetupWithManager(mctx, mgr); err != nil {
		cancel()
		cp.Stop()
		return nil, err
	}
	if err := (&controllers.PolicyReconciler{Redis: cp.RDB, Evaluations: evaluations, Options: opts}).SetupWithManager(mctx, mgr); err != nil {
		cancel()
		cp.Stop()
		return nil, err
	}
	cp.stopManager = cancel
	cp.managerDone = make(chan error, 1)
	go func() { cp.managerDone <- mgr.Start(mctx) }()
	return cp, nil
}

// Stop stops the manager, Redis and the API server, in that order.
func (cp *ControlPlane) Stop() {
	if cp.stopManager != nil {
		cp.stopManager()
		select {
		case <-cp.managerDone:
		case <-time.After(10 * time.Second):
		}
	}
	if cp.Redis != nil {
		_ = cp.Redis.Close()
	}
	if cp.Env != nil {
		_ = cp.Env.Stop()
	}
}

// Workload names what Install creates.
type Workload struct {
	Namespace, Policy, ScaledObject, Deployment string
}

// Install creates the namespace, the workers' Deployment and their KEDA
// ScaledObject (with the user's own min and max), and the policy naming that
// ScaledObject as its consumer; it returns the Fleet that connects a replay to
// them.
func (cp *ControlPlane) Install(ctx context.Context, w Workload, spec spillwayv1alpha1.DependencyPolicySpec, minReplicas, maxReplicas int32) (Fleet, error) {
	c := cp.Env.Client
	objs := []client.Object{
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: w.Namespace}},
		deployment(w, minReplicas),
		&kedav1alpha1.ScaledObject{
			ObjectMeta: metav1.ObjectMeta{Namespace: w.Namespace, Name: w.ScaledObject},
			Spec: kedav1alpha1.ScaledObjectSpec{
				ScaleTargetRef:  &kedav1alpha1.ScaleTarget{Name: w.Deployment},
				MinReplicaCount: ptr(minReplicas),
				MaxReplicaCount: ptr(maxReplicas),
				Triggers: []kedav1alpha1.ScaleTriggers{{
					Type:     "redis",
					Metadata: map[string]string{"listName": "jobs", "listLength": "10"},
				}},
			},
		},
		&spillwayv1alpha1.DependencyPolicy{
			ObjectMeta: metav1.ObjectMeta{Namespace: w.Namespace, Name: w.Policy},
			Spec:       spec,
		},
	}
	for _, o := range objs {
		if err := c.Create(ctx, o); err != nil {
			return Fleet{}, fmt.Errorf("failed to create %T %s: %w", o, o.GetName(), err)
		}
	}
	g, err := guard.New(cp.RDB, w.Namespace+"/"+w.Policy, guard.Options{RedisTimeout: 250 * time.Millisecond})
	if err != nil {
		return Fleet{}, err
	}
	proto, err := protocol.NewClient(cp.RDB, protocol.Dependency{Namespace: w.Namespace, Name: w.Policy})
	if err != nil {
		return Fleet{}, err
	}
	return Fleet{
		Guard: g,
		Bounds: func(ctx context.Context) (int, int, error) {
			var so kedav1alpha1.ScaledObject
			if err := c.Get(ctx, types.NamespacedName{Namespace: w.Namespace, Name: w.ScaledObject}, &so); err != nil {
				return 0, 0, err
			}
			lo, hi := int32(0), int32(100) // KEDA's defaults
			if so.Spec.MinReplicaCount != nil {
				lo = *so.Spec.MinReplicaCount
			}
			if so.Spec.MaxReplicaCount != nil {
				hi = *so.Spec.MaxReplicaCount
			}
			return int(lo), int(hi), nil
		},
		Scale: func(ctx context.Context, replicas int) error {
			scale := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Namespace: w.Namespace, Name: w.Deployment}}
			patch := client.RawPatch(types.MergePatchType, fmt.Appendf(nil, `{"spec":{"replicas":%d}}`, replicas))
			return c.SubResource("scale").Patch(ctx, scale, patch)
		},
		Status: func(ctx context.Context) (string, int64) {
			p, ok, err := proto.ReadPublished(ctx)
			if err != nil || !ok {
				return "", 0
			}
			return string(p.State), p.Limit
		},
	}, nil
}

// WaitBounded waits until the controller has bounded the ScaledObject, so a
// replay starts from the steady state.
func (cp *ControlPlane) WaitBounded(ctx context.Context, w Workload, fleet Fleet, maxReplicas int) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for {
		_, hi, err := fleet.Bounds(ctx)
		state, _ := fleet.Status(ctx)
		if err == nil && hi <= maxReplicas && state != "" {
			return nil
		}
		select {
		case <-ctx.Done():
			return errors.New("the controller did not bound the ScaledObject and publish the policy within 30s")
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func deployment(w Workload, replicas int32) *appsv1.Deployment {
	labels := map[string]string{"app": w.Deployment}
	return &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Namespace: w.Namespace, Name: w.Deployment},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr(replicas),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "worker", Image: "worker"}}},
			},
		},
	}
}

func ptr[T any](v T) *T { return &v }
