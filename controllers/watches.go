package controllers

import (
	"context"
	"fmt"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
)

// This file is what enqueues the policy reconciler besides its policies and
// the evaluator's triggers: changes to ScaledObjects and HPAs, mapped to
// their policies through field indexes.

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
