package controllers

import (
	"fmt"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/client"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
)

// A consumer's autoscaler is a KEDA ScaledObject or an autoscaling/v2
// HorizontalPodAutoscaler. Spillway treats both alike: it bounds the
// maximum, pins the minimum, records the user's values in annotations and
// gives them back. Only the names of the two fields, and what an unset one
// means, differ; an autoscalerKind holds them, and the planner (binding.go)
// reads an autoscaler through that small interface alone.

// autoscalerKind is what differs between the kinds of autoscaler Spillway
// bounds.
type autoscalerKind struct {
	// GroupVersion and Kind are what Spillway applies.
	GroupVersion schema.GroupVersion
	Kind         string
	// MinField and MaxField are the JSON names of the replica fields under
	// spec.
	MinField, MaxField string
	// DefaultMin is the minimum an unset min means.
	DefaultMin int32
	// DefaultMax is the maximum an unset max means; 0 when the max is
	// required and so never unset. Spillway leaves an unset max unset while
	// the bound is not below DefaultMax.
	DefaultMax int32
	// LogKey names an object of the kind in logs.
	LogKey string
	// NotFound is the ConsumersBounded reason for a consumer whose
	// autoscaler does not exist.
	NotFound string
}

var (
	// scaledObjectKind: KEDA's ScaledObject, whose unset minReplicaCount
	// means 0 and unset maxReplicaCount 100.
	scaledObjectKind = &autoscalerKind{
		GroupVersion: kedav1alpha1.GroupVersion,
		Kind:         "ScaledObject",
		MinField:     "minReplicaCount",
		MaxField:     "maxReplicaCount",
		DefaultMin:   0,
		DefaultMax:   KEDADefaultMaxReplicas,
		LogKey:       "scaledObject",
		NotFound:     ReasonScaledObjectNotFound,
	}
	// hpaKind: the autoscaling/v2 HorizontalPodAutoscaler, whose minReplicas
	// defaults to 1 and whose maxReplicas is required.
	hpaKind = &autoscalerKind{
		GroupVersion: autoscalingv2.SchemeGroupVersion,
		Kind:         "HorizontalPodAutoscaler",
		MinField:     "minReplicas",
		MaxField:     "maxReplicas",
		DefaultMin:   1,
		DefaultMax:   0,
		LogKey:       "horizontalPodAutoscaler",
		NotFound:     ReasonHorizontalPodAutoscalerNotFound,
	}
)

// autoscaler is a consumer's autoscaler, as Spillway reads it. The interface
// is not a client.Object, so that the compiler keeps a wrapper from being
// handed to a client (whose scheme knows only the API types): object is.
type autoscaler interface {
	metav1.Object
	// object is the API object, to read into and to write.
	object() client.Object
	// kind describes the autoscaler's replica fields.
	kind() *autoscalerKind
	// replicas is the live min and max; nil means unset.
	replicas() Replicas
	// scaleTarget is the workload the autoscaler scales, as apiVersion, kind
	// and name; the apiVersion and kind are empty when not set.
	scaleTarget() (apiVersion, kind, name string)
}

// soAutoscaler is a KEDA ScaledObject as an autoscaler.
type soAutoscaler struct{ *kedav1alpha1.ScaledObject }

func (soAutoscaler) kind() *autoscalerKind { return scaledObjectKind }

func (s soAutoscaler) object() client.Object { return s.ScaledObject }

func (s soAutoscaler) replicas() Replicas {
	return Replicas{Min: s.Spec.MinReplicaCount, Max: s.Spec.MaxReplicaCount}
}

func (s soAutoscaler) scaleTarget() (string, string, string) {
	ref := s.Spec.ScaleTargetRef
	if ref == nil {
		return "", "", ""
	}
	return ref.APIVersion, ref.Kind, ref.Name
}

// hpaAutoscaler is an autoscaling/v2 HorizontalPodAutoscaler as an
// autoscaler.
type hpaAutoscaler struct {
	*autoscalingv2.HorizontalPodAutoscaler
}

func (hpaAutoscaler) kind() *autoscalerKind { return hpaKind }

func (h hpaAutoscaler) object() client.Object { return h.HorizontalPodAutoscaler }

func (h hpaAutoscaler) replicas() Replicas {
	return Replicas{Min: h.Spec.MinReplicas, Max: ptrTo(h.Spec.MaxReplicas)}
}

func (h hpaAutoscaler) scaleTarget() (string, string, string) {
	ref := h.Spec.ScaleTargetRef
	return ref.APIVersion, ref.Kind, ref.Name
}

// consumerRef names a consumer's autoscaler in the policy's namespace.
type consumerRef struct {
	Kind *autoscalerKind
	Name string
}

// refOf is the autoscaler c names; c is not a scaleTargetRef consumer.
func refOf(c spillwayv1alpha1.Consumer) consumerRef {
	if c.HorizontalPodAutoscalerName != "" {
		return consumerRef{Kind: hpaKind, Name: c.HorizontalPodAutoscalerName}
	}
	return consumerRef{Kind: scaledObjectKind, Name: c.ScaledObjectName}
}

// String names the consumer in conditions: a ScaledObject by its name alone
// (as before HPAs could be consumers), an HPA as
// "HorizontalPodAutoscaler/<name>".
func (c consumerRef) String() string {
	if c.Kind == scaledObjectKind {
		return c.Name
	}
	return c.Kind.Kind + "/" + c.Name
}

// newObject is an empty object of the kind, to read one into.
func (c consumerRef) newObject() autoscaler {
	if c.Kind == hpaKind {
		return hpaAutoscaler{&autoscalingv2.HorizontalPodAutoscaler{}}
	}
	return soAutoscaler{&kedav1alpha1.ScaledObject{}}
}

// scaledObjectOwner is the name of the ScaledObject that owns hpa (KEDA
// makes an HPA, keda-hpa-<name>, for each ScaledObject and owns it), or ""
// when none does. Such an HPA is KEDA's to write: Spillway bounds the
// ScaledObject instead.
func scaledObjectOwner(hpa *autoscalingv2.HorizontalPodAutoscaler) string {
	for _, o := range hpa.OwnerReferences {
		gv, err := schema.ParseGroupVersion(o.APIVersion)
		if err == nil && gv.Group == kedav1alpha1.GroupVersion.Group && o.Kind == scaledObjectKind.Kind {
			return o.Name
		}
	}
	return ""
}

// refusal is why Spillway does not bound a, or nil when it may.
func refusal(a autoscaler) *consumerResult {
	h, ok := a.(hpaAutoscaler)
	if !ok {
		return nil
	}
	if owner := scaledObjectOwner(h.HorizontalPodAutoscaler); owner != "" {
		return &consumerResult{
			Reason: ReasonOwnedByScaledObject,
			Message: fmt.Sprintf("the HorizontalPodAutoscaler belongs to ScaledObject %s, and KEDA overwrites its replicas: "+
				"name the ScaledObject instead (scaledObjectName: %s)", owner, owner),
		}
	}
	return nil
}
