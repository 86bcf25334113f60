package controllers

import (
	"context"
	"fmt"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
)

// This file is what enqueues the policy reconciler besides its policies and
// the evaluator's triggers: changes to ScaledObjects and HPAs, mapped to
// their policies through field indexes, and changes to the workloads without
// an autoscaler that a policy bounds, mapped through their LabelBoundedBy.

const (
	// IndexConsumer indexes DependencyPolicies by the names of the
	// ScaledObjects they list as consumers.
	IndexConsumer = "spec.consumers.scaledObjectName"
	// IndexHPAConsumer indexes DependencyPolicies by the names of the
	// HorizontalPodAutoscalers they list as consumers.
	IndexHPAConsumer = "spec.consumers.horizontalPodAutoscalerName"
	// IndexOwner indexes ScaledObjects and HorizontalPodAutoscalers by their
	// AnnotationOwner.
	IndexOwner = "metadata.annotations.spillway.dev/owner"
)

// setupIndexes registers IndexConsumer, IndexHPAConsumer and IndexOwner with
// mgr's cache; IndexOwner of ScaledObjects only when scaledObjects (KEDA's
// CRD is served), else watchScaledObjectsOnceServed registers it later.
func setupIndexes(ctx context.Context, mgr ctrl.Manager, scaledObjects bool) error {
	indexer := mgr.GetFieldIndexer()
	if err := indexer.IndexField(ctx, &spillwayv1alpha1.DependencyPolicy{}, IndexConsumer, consumerNames); err != nil {
		return fmt.Errorf("failed to index DependencyPolicies by consumer: %w", err)
	}
	if err := indexer.IndexField(ctx, &spillwayv1alpha1.DependencyPolicy{}, IndexHPAConsumer, hpaConsumerNames); err != nil {
		return fmt.Errorf("failed to index DependencyPolicies by HorizontalPodAutoscaler consumer: %w", err)
	}
	if scaledObjects {
		if err := indexer.IndexField(ctx, &kedav1alpha1.ScaledObject{}, IndexOwner, ownerName); err != nil {
			return fmt.Errorf("failed to index ScaledObjects by owner: %w", err)
		}
	}
	if err := indexer.IndexField(ctx, &autoscalingv2.HorizontalPodAutoscaler{}, IndexOwner, ownerName); err != nil {
		return fmt.Errorf("failed to index HorizontalPodAutoscalers by owner: %w", err)
	}
	return nil
}

// policiesFor maps a ScaledObject or an HPA to the policies that name it as
// a consumer, and to the one its owner annotation names.
func (r *PolicyReconciler) policiesFor(ctx context.Context, obj client.Object) []reconcile.Request {
	index := IndexConsumer
	if _, ok := obj.(*autoscalingv2.HorizontalPodAutoscaler); ok {
		index = IndexHPAConsumer
	}
	var list spillwayv1alpha1.DependencyPolicyList
	if err := r.Client.List(ctx, &list, client.InNamespace(obj.GetNamespace()), client.MatchingFields{index: obj.GetName()}); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "Failed to list the policies of an autoscaler", "autoscaler", klog.KObj(obj))
	}
	seen := map[string]bool{}
	var reqs []reconcile.Request
	add := func(name string) {
		if name != "" && !seen[name] {
			seen[name] = true
			reqs = append(reqs, reconcile.Request{NamespacedName: types.NamespacedName{Namespace: obj.GetNamespace(), Name: name}})
		}
	}
	for _, p := range list.Items {
		add(p.Name)
	}
	add(obj.GetAnnotations()[AnnotationOwner])
	return reqs
}

// autoscalerHandler enqueues the policies of an autoscaler (a ScaledObject
// or an HPA) that changed, and forgets a deleted one's cached scale check.
type autoscalerHandler struct {
	handler.EventHandler
	forget func(types.UID)
}

// Delete forgets the autoscaler and enqueues its policies.
func (h autoscalerHandler) Delete(ctx context.Context, e event.DeleteEvent, q workqueue.TypedRateLimitingInterface[reconcile.Request]) {
	if e.Object != nil {
		h.forget(e.Object.GetUID())
	}
	h.EventHandler.Delete(ctx, e, q)
}

// consumerNames is the IndexConsumer index function.
func consumerNames(obj client.Object) []string {
	pol, ok := obj.(*spillwayv1alpha1.DependencyPolicy)
	if !ok {
		return nil
	}
	names := make([]string, 0, len(pol.Spec.Consumers))
	for _, c := range pol.Spec.Consumers {
		if c.ScaledObjectName != "" {
			names = append(names, c.ScaledObjectName)
		}
	}
	return names
}

// hpaConsumerNames is the IndexHPAConsumer index function.
func hpaConsumerNames(obj client.Object) []string {
	pol, ok := obj.(*spillwayv1alpha1.DependencyPolicy)
	if !ok {
		return nil
	}
	var names []string
	for _, c := range pol.Spec.Consumers {
		if c.HorizontalPodAutoscalerName != "" {
			names = append(names, c.HorizontalPodAutoscalerName)
		}
	}
	return names
}

// ownerName is the IndexOwner index function.
func ownerName(obj client.Object) []string {
	if owner := obj.GetAnnotations()[AnnotationOwner]; owner != "" {
		return []string{owner}
	}
	return nil
}

// boundWorkloadKinds are the workload kinds whose changes enqueue the policy
// that bounds them. A workload of another kind (a Rollout) is read again at
// each reconcile of its policy, at least every status interval.
var boundWorkloadKinds = []string{"Deployment", "StatefulSet", "ReplicaSet"}

// +kubebuilder:rbac:groups=apps,resources=deployments;statefulsets;replicasets,verbs=list;watch

// boundWorkloadSources watch, in a metadata-only cache of their own that
// holds only objects labelled LabelBoundedBy (without managedFields), the
// Deployments, StatefulSets and ReplicaSets the policies bound. A change of
// their spec (a kubectl scale, a sync) or of Spillway's label and
// annotations enqueues the policy the label names, so the controller records
// or lowers it at once; the many workloads no policy names are never cached.
func (r *PolicyReconciler) boundWorkloadSources(mgr ctrl.Manager) ([]source.Source, error) {
	selector, err := labels.Parse(LabelBoundedBy)
	if err != nil {
		return nil, fmt.Errorf("failed to build the bound workloads' selector: %w", err)
	}
	c, err := cache.New(mgr.GetConfig(), cache.Options{
		Scheme:               mgr.GetScheme(),
		Mapper:               mgr.GetRESTMapper(),
		DefaultLabelSelector: selector,
		DefaultTransform:     cache.TransformStripManagedFields(),
	})
	if err != nil {
		return nil, fmt.Errorf("failed to create the bound workloads' cache: %w", err)
	}
	if err := mgr.Add(c); err != nil {
		return nil, err
	}
	changed := predicate.Or[client.Object](predicate.GenerationChangedPredicate{}, predicate.LabelChangedPredicate{}, predicate.AnnotationChangedPredicate{})
	sources := make([]source.Source, 0, len(boundWorkloadKinds))
	for _, kind := range boundWorkloadKinds {
		obj := &metav1.PartialObjectMetadata{}
		obj.SetGroupVersionKind(appsv1.SchemeGroupVersion.WithKind(kind))
		sources = append(sources, source.Kind[client.Object](c, obj, handler.EnqueueRequestsFromMapFunc(r.boundPolicy), changed))
	}
	return sources, nil
}

// boundPolicy maps a bound workload to the policy its LabelBoundedBy names,
// when the manager's cache holds that policy (a manager restricted to some
// namespaces ignores the others).
func (r *PolicyReconciler) boundPolicy(ctx context.Context, obj client.Object) []reconcile.Request {
	name := obj.GetLabels()[LabelBoundedBy]
	if name == "" {
		return nil
	}
	key := types.NamespacedName{Namespace: obj.GetNamespace(), Name: name}
	if err := r.Client.Get(ctx, key, &spillwayv1alpha1.DependencyPolicy{}); err != nil {
		return nil
	}
	return []reconcile.Request{{NamespacedName: key}}
}
