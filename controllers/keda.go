package controllers

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	"sigs.k8s.io/controller-runtime/pkg/source"
)

// This file lets the manager run in a cluster without KEDA: HPAs are bounded
// as ever, a ScaledObject consumer is reported with ReasonKEDANotInstalled,
// and once KEDA's ScaledObject CRD is served the ScaledObject index and watch
// start, without a restart.

// DefaultKEDADiscoveryInterval is how often a manager started without KEDA's
// ScaledObject CRD asks the API server's discovery whether it is served now.
const DefaultKEDADiscoveryInterval = 10 * time.Second

// kedaState is whether the policy reconciler watches ScaledObjects. Its zero
// value means it does, as when KEDA was installed at start.
type kedaState struct {
	// missing is true from a start without KEDA's ScaledObject CRD until the
	// ScaledObject index and watch are running.
	missing atomic.Bool
}

// scaledObjectsServed reports whether the API server serves KEDA's
// ScaledObject (keda.sh/v1alpha1). A discovery failure other than "no such
// kind" is returned.
func scaledObjectsServed(mapper meta.RESTMapper) (bool, error) {
	_, err := mapper.RESTMapping(kedav1alpha1.GroupVersion.WithKind("ScaledObject").GroupKind(), kedav1alpha1.GroupVersion.Version)
	switch {
	case err == nil:
		return true, nil
	case meta.IsNoMatchError(err):
		return false, nil
	}
	return false, fmt.Errorf("failed to discover KEDA's ScaledObject kind: %w", err)
}

// scaledObjectHandler enqueues the policies of a ScaledObject that changed.
func (r *PolicyReconciler) scaledObjectHandler() handler.EventHandler {
	return autoscalerHandler{
		EventHandler: handler.EnqueueRequestsFromMapFunc(r.policiesFor),
		forget:       func(uid types.UID) { r.scaleChecks.Delete(uid) },
	}
}

// watchScaledObjectsOnceServed is a manager runnable (leader-elected, like the
// controller c): every interval it asks whether ScaledObjects are served,
// and once they are, indexes them by owner, watches them for c and clears
// r.keda.missing. The watch's first list enqueues the policies of every
// existing ScaledObject; those that named one that does not exist yet
// retry on their own backoff.
func (r *PolicyReconciler) watchScaledObjectsOnceServed(mgr ctrl.Manager, c controller.Controller, interval time.Duration) manager.Runnable {
	return manager.RunnableFunc(func(ctx context.Context) error {
		log := ctrl.Log.WithName(ControllerName)
		tick := time.NewTicker(interval)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return nil
			case <-tick.C:
			}
			served, err := scaledObjectsServed(mgr.GetRESTMapper())
			if err != nil {
				log.Error(err, "Failed to ask whether KEDA is installed; asking again", "after", interval)
				continue
			}
			if !served {
				continue
			}
			if err := mgr.GetFieldIndexer().IndexField(ctx, &kedav1alpha1.ScaledObject{}, IndexOwner, ownerName); err != nil {
				log.Error(err, "Failed to index ScaledObjects by owner; trying again", "after", interval)
				continue
			}
			r.keda.missing.Store(false)
			if err := c.Watch(source.Kind[client.Object](mgr.GetCache(), &kedav1alpha1.ScaledObject{}, r.scaledObjectHandler())); err != nil {
				return fmt.Errorf("failed to watch ScaledObjects after KEDA was installed: %w", err)
			}
			log.Info("KEDA's ScaledObject CRD is installed now: watching ScaledObjects, without a restart")
			return nil
		}
	})
}
