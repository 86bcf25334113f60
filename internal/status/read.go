package status

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	"github.com/redis/go-redis/v9"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/controller-runtime/pkg/client"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// Reader reads the rows: the policies and their consumers' autoscalers from
// the API server, the rest from Redis.
type Reader struct {
	// Client reads DependencyPolicies (list), ScaledObjects and
	// HorizontalPodAutoscalers (get); its scheme must know the three.
	Client client.Reader
	// Redis is where the controller publishes; nil reads the cluster only.
	Redis redis.UniversalClient
	// RedisTimeout bounds each policy's Redis reads; 0 means 2s.
	RedisTimeout time.Duration
	// Now is the clock of Report.Time; nil means time.Now.
	Now func() time.Time
}

// Read reads the policies in namespace ("" for every namespace), only those
// named when names is not empty. A failure to read the policies is an
// error; a Redis that cannot be read is not: the report says so in
// RedisUnreachable and its rows have no Redis part.
func (r *Reader) Read(ctx context.Context, namespace string, names []string) (Report, error) {
	now := time.Now
	if r.Now != nil {
		now = r.Now
	}
	var list spillwayv1alpha1.DependencyPolicyList
	if err := r.Client.List(ctx, &list, client.InNamespace(namespace)); err != nil {
		return Report{}, fmt.Errorf("failed to list DependencyPolicies: %w", err)
	}
	pols := list.Items
	if len(names) > 0 {
		pols = slices.DeleteFunc(pols, func(p spillwayv1alpha1.DependencyPolicy) bool { return !slices.Contains(names, p.Name) })
		for _, n := range names {
			if !slices.ContainsFunc(pols, func(p spillwayv1alpha1.DependencyPolicy) bool { return p.Name == n }) {
				return Report{}, fmt.Errorf("DependencyPolicy %q not found", n)
			}
		}
	}
	slices.SortFunc(pols, func(a, b spillwayv1alpha1.DependencyPolicy) int {
		return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name))
	})
	rep := Report{Items: make([]Row, 0, len(pols))}
	for i := range pols {
		as, err := r.autoscalers(ctx, &pols[i])
		if err != nil {
			return Report{}, err
		}
		rep.Items = append(rep.Items, FromCluster(&pols[i], as))
	}
	if r.Redis != nil {
		for i := range rep.Items {
			row, err := r.withRedis(ctx, rep.Items[i])
			if err == nil {
				rep.Items[i] = row
				continue
			}
			if errors.Is(err, protocol.ErrVersion) {
				rep.Items[i].RedisError = err.Error()
				continue
			}
			// Unreachable: asking again for each policy would only wait
			// out the timeout once more.
			rep.RedisUnreachable = err.Error()
			for j := i; j < len(rep.Items); j++ {
				rep.Items[j].RedisError = err.Error()
			}
			break
		}
	}
	rep.Time = metav1.Time{Time: now()}
	return rep, nil
}

// autoscalers gets pol's consumers' autoscalers. Not found is an answer, as
// is a kind the API server does not serve or the user may not read; a
// context ended is an error.
func (r *Reader) autoscalers(ctx context.Context, pol *spillwayv1alpha1.DependencyPolicy) (Autoscalers, error) {
	as := Autoscalers{
		ScaledObjects: map[string]*kedav1alpha1.ScaledObject{},
		HPAs:          map[string]*autoscalingv2.HorizontalPodAutoscaler{},
	}
	for _, c := range pol.Spec.Consumers {
		if ref := c.ScaleTargetRef; ref != nil {
			if err := r.workload(ctx, pol.Namespace, ref, &as); err != nil {
				return Autoscalers{}, err
			}
			continue
		}
		var (
			obj    client.Object
			name   string
			kindOK = &as.HPAsErr
		)
		if c.ScaledObjectName != "" {
			obj, name, kindOK = &kedav1alpha1.ScaledObject{}, c.ScaledObjectName, &as.ScaledObjectsErr
		} else {
			obj, name = &autoscalingv2.HorizontalPodAutoscaler{}, c.HorizontalPodAutoscalerName
		}
		if *kindOK != nil {
			continue
		}
		err := r.Client.Get(ctx, client.ObjectKey{Namespace: pol.Namespace, Name: name}, obj)
		switch {
		case err == nil:
			if so, ok := obj.(*kedav1alpha1.ScaledObject); ok {
				as.ScaledObjects[name] = so
			} else {
				as.HPAs[name] = obj.(*autoscalingv2.HorizontalPodAutoscaler)
			}
		case apierrors.IsNotFound(err):
		case ctx.Err() != nil:
			return Autoscalers{}, fmt.Errorf("failed to read the consumers of %s/%s: %w", pol.Namespace, pol.Name, ctx.Err())
		default:
			*kindOK = err
		}
	}
	return as, nil
}

// workload gets a scaleTargetRef consumer's workload into as.
func (r *Reader) workload(ctx context.Context, namespace string, ref *spillwayv1alpha1.ScaleTargetRef, as *Autoscalers) error {
	if as.Workloads == nil {
		as.Workloads, as.WorkloadErrs = map[string]*unstructured.Unstructured{}, map[string]error{}
	}
	key := ref.Kind + "/" + ref.Name
	apiVersion := cmp.Or(ref.APIVersion, "apps/v1")
	w := &unstructured.Unstructured{}
	w.SetAPIVersion(apiVersion)
	w.SetKind(ref.Kind)
	err := r.Client.Get(ctx, client.ObjectKey{Namespace: namespace, Name: ref.Name}, w)
	switch {
	case err == nil:
		as.Workloads[key] = w
	case apierrors.IsNotFound(err):
	case ctx.Err() != nil:
		return fmt.Errorf("failed to read the consumers in %s: %w", namespace, ctx.Err())
	default:
		as.WorkloadErrs[key] = err
	}
	return nil
}

// withRedis adds to row what Redis holds for its policy.
func (r *Reader) withRedis(ctx context.Context, row Row) (Row, error) {
	timeout := r.RedisTimeout
	if timeout <= 0 {
		timeout = 2 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	pc, err := protocol.NewClient(r.Redis, protocol.Dependency{Namespace: row.Namespace, Name: row.Name})
	if err != nil {
		return row, err
	}
	published, ok, redisNow, err := pc.ReadPublishedAt(ctx)
	if err != nil {
		return row, err
	}
	if !ok {
		return WithRedis(row, published, false, 0, protocol.Window{}), nil
	}
	// The breaker window, as the controller counts it (the controller
	// itself may count from a later start, after a transition), read with
	// plain HMGETs: the controller's window script would also write its
	// cached totals, prune and sweep leases, and status writes nothing.
	window, err := pc.PeekWindow(ctx, published.BreakerWindow, redisNow)
	if err != nil {
		return row, err
	}
	// Live leases are those scored after now (docs/protocol.md, "Leases").
	inFlight, err := r.Redis.ZCount(ctx, pc.Keys().Leases, "("+strconv.FormatInt(redisNow.UnixMilli(), 10), "+inf").Result()
	if err != nil {
		return row, fmt.Errorf("failed to count the leases of %s/%s: %w", row.Namespace, row.Name, err)
	}
	row = WithRedis(row, published, ok, inFlight, window)
	// Which protocol versions the workers speak: read only, and a failure
	// leaves the columns empty rather than failing the row.
	if fleet, err := pc.ReadFleet(ctx); err == nil {
		row = WithFleet(row, fleet)
	}
	return row, nil
}
