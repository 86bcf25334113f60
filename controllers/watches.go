package controllers

import (
	"context"
	"fmt"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
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
// the evaluator's triggers: changes to ScaledObjects, mapped to their
// policies through two field indexes.

const (
	// IndexConsumer indexes DependencyPolicies by the names of the
	// ScaledObjects they list as consumers.
	IndexConsumer = "spec.consumers.scaledObjectName"
	// IndexOwner indexes ScaledObjects by their AnnotationOwner.
	IndexOwner = "metadata.annotations.spillway.dev/owner"
)

// setupIndexes registers IndexConsumer and IndexOwner with mgr's cache.
func setupIndexes(ctx context.Context, mgr ctrl.Manager) error {
	if err := mgr.GetFieldIndexer().IndexField(ctx, &spillwayv1alpha1.DependencyPolicy{}, IndexConsumer, consumerNames); err != nil {
		return fmt.Errorf("failed to index DependencyPolicies by consumer: %w", err)
	}
	if err := mgr.GetFieldIndexer().IndexField(ctx, &kedav1alpha1.ScaledObject{}, IndexOwner, ownerName); err != nil {
		return fmt.Errorf("failed to index ScaledObjects by owner: %w", err)
	}
	return nil
}

// policiesFor maps a ScaledObject to the policies that name it as a consumer,
// and to the one its owner annotation names.
func (r *PolicyReconciler) policiesFor(ctx context.Context, obj client.Object) []reconcile.Request {
	var list spillwayv1alpha1.DependencyPolicyList
	if err := r.Client.List(ctx, &list, client.InNamespace(obj.GetNamespace()), client.MatchingFields{IndexConsumer: obj.GetName()}); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "Failed to list the policies of a ScaledObject", "scaledObject", klog.KObj(obj))
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

// scaledObjectHandler enqueues the policies of a ScaledObject that changed,
// and forgets a deleted ScaledObject's cached scale check.
type scaledObjectHandler struct {
	handler.EventHandler
	forget func(types.UID)
}

// Delete forgets the ScaledObject and enqueues its policies.
func (h scaledObjectHandler) Delete(ctx context.Context, e event.DeleteEvent, q workqueue.TypedRateLimitingInterface[reconcile.Request]) {
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
		names = append(names, c.ScaledObjectName)
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
