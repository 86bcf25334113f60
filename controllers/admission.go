package controllers

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	admissionv1 "k8s.io/api/admission/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
)

// This file is the validating admission webhook: it refuses, with a message
// that says why and what to change instead, a change that would run more
// replicas than a consumer's bound. It reads policies from the manager's
// cache, so every replica of the manager serves it, leader or not. The API
// server calls it only for the objects Spillway bounds (see
// config/webhook/manifests.yaml): workloads carrying LabelBoundedBy, the
// autoscalers carrying AnnotationOwner, and scale subresource writes other
// than the HPA controller's. Its failurePolicy is Ignore: a manager that is
// down never blocks a deploy.

// WebhookPath is where the manager serves the validating webhook.
const WebhookPath = "/validate-replicas"

// AnnotationPausedReplicas is KEDA's annotation that freezes a ScaledObject's
// workload at the given replicas.
const AnnotationPausedReplicas = "autoscaling.keda.sh/paused-replicas"

// ReplicasValidator is the admission.Handler of the validating webhook.
type ReplicasValidator struct {
	// Client reads DependencyPolicies, from the manager's cache.
	Client client.Reader
	// Mapper maps a scale request's resource to its kind.
	Mapper meta.RESTMapper
}

// +kubebuilder:rbac:groups=admissionregistration.k8s.io,resources=validatingwebhookconfigurations,verbs=get;list;watch;update

// Handle answers one admission request.
func (v *ReplicasValidator) Handle(ctx context.Context, req admission.Request) admission.Response {
	if req.Operation != admissionv1.Create && req.Operation != admissionv1.Update {
		return admission.Allowed("")
	}
	// The controller's own writes (the user's replicas put back, a bound
	// raised as the ramp climbs) go through: the webhook guards against
	// mistakes, RBAC against intent.
	if fieldManagerOf(req) == FieldManager {
		return admission.Allowed("")
	}
	obj, err := decode(req.Object.Raw)
	if err != nil {
		return admission.Errored(http.StatusBadRequest, err)
	}
	var old map[string]any
	if len(req.OldObject.Raw) > 0 {
		if old, err = decode(req.OldObject.Raw); err != nil {
			return admission.Errored(http.StatusBadRequest, err)
		}
	}
	var check replicaCheck
	switch {
	case req.SubResource == "scale":
		gvk, err := v.Mapper.KindFor(schema.GroupVersionResource{Group: req.Resource.Group, Version: req.Resource.Version, Resource: req.Resource.Resource})
		if err != nil {
			return admission.Allowed("")
		}
		check = workloadCheck(workloadRef{APIVersion: gvk.GroupVersion().String(), Kind: gvk.Kind, Name: req.Name}, obj, old, "kubectl scale")
	case req.SubResource != "":
		return admission.Allowed("")
	case req.Kind.Group == kedav1alpha1.GroupVersion.Group && req.Kind.Kind == scaledObjectKind.Kind:
		check = autoscalerCheck(scaledObjectKind, req.Name, obj, old)
	case req.Kind.Group == autoscalingv2.GroupName && req.Kind.Kind == hpaKind.Kind:
		check = autoscalerCheck(hpaKind, req.Name, obj, old)
	default:
		check = workloadCheck(workloadRef{APIVersion: schema.GroupVersion{Group: req.Kind.Group, Version: req.Kind.Version}.String(), Kind: req.Kind.Kind, Name: req.Name}, obj, old, "spec.replicas")
	}
	if len(check.asks) == 0 {
		return admission.Allowed("")
	}
	var policies spillwayv1alpha1.DependencyPolicyList
	if err := v.Client.List(ctx, &policies, client.InNamespace(req.Namespace)); err != nil {
		// failurePolicy Ignore: a webhook that cannot answer lets the change
		// through, and the controller bounds it afterwards.
		ctrl.LoggerFrom(ctx).Error(err, "Failed to list policies; allowing the change", "namespace", req.Namespace)
		return admission.Allowed("")
	}
	if msg, b := admissionRefusal(policies.Items, check); msg != "" {
		ctrl.LoggerFrom(ctx).V(1).Info("Refused a change above a consumer's bound", "policy", klog.KObj(b.policy), "consumer", b.consumer, "bound", b.bound)
		return admission.Denied(msg)
	}
	return admission.Allowed("")
}

// admissionRefusal is why check is refused under policies, and the bound it breaks;
// "" when it is allowed: when no policy bounds the object, or no value it
// asks for is raised above the bound.
func admissionRefusal(policies []spillwayv1alpha1.DependencyPolicy, check replicaCheck) (string, *policyBound) {
	b := strictestBound(policies, check.matches)
	if b == nil {
		return "", nil
	}
	for _, a := range check.asks {
		if a.value > int64(b.bound) && a.value > a.was {
			return refusalMessage(b, a), b
		}
	}
	return "", nil
}

// ask is one replica count a request asks for: value, where the object had
// was before (the request is refused only when it raises a value above the
// bound, so an unrelated edit of an object the controller has not lowered
// yet goes through), and how the request asked for it.
type ask struct {
	value, was int64
	field      string
}

// replicaCheck is what a request asks for and which consumers it concerns.
type replicaCheck struct {
	asks    []ask
	matches func(spillwayv1alpha1.Consumer) (string, bool)
}

// workloadCheck is the check of a write to workload w (the object itself or
// its Scale): its spec.replicas.
func workloadCheck(w workloadRef, obj, old map[string]any, field string) replicaCheck {
	replicas, ok := nestedInt(obj, "spec", "replicas")
	if !ok {
		return replicaCheck{}
	}
	was, ok := nestedInt(old, "spec", "replicas")
	if !ok {
		was = -1
	}
	return replicaCheck{
		asks: []ask{{value: replicas, was: was, field: field}},
		matches: func(c spillwayv1alpha1.Consumer) (string, bool) {
			return w.Name, c.ScaleTargetRef != nil && sameWorkload(workloadOf(c.ScaleTargetRef), w)
		},
	}
}

// autoscalerCheck is the check of a write to an autoscaler of kind k: its
// maximum (KEDA's default of 100 when unset) and, on a ScaledObject, the
// replicas KEDA's paused-replicas annotation freezes it at.
func autoscalerCheck(k *autoscalerKind, name string, obj, old map[string]any) replicaCheck {
	maxOf := func(o map[string]any) int64 {
		v, ok := nestedInt(o, "spec", k.MaxField)
		if !ok {
			if o == nil || k.DefaultMax == 0 {
				return -1
			}
			return int64(k.DefaultMax)
		}
		return v
	}
	c := replicaCheck{
		asks: []ask{{value: maxOf(obj), was: maxOf(old), field: "spec." + k.MaxField}},
		matches: func(c spillwayv1alpha1.Consumer) (string, bool) {
			if k == hpaKind {
				return name, c.HorizontalPodAutoscalerName == name
			}
			return name, c.ScaledObjectName == name
		},
	}
	if k == scaledObjectKind {
		if p, ok := pausedReplicas(obj); ok {
			was, ok := pausedReplicas(old)
			if !ok {
				was = -1
			}
			c.asks = append(c.asks, ask{value: p, was: was, field: AnnotationPausedReplicas})
		}
	}
	return c
}

// policyBound is the bound of the consumer a request concerns.
type policyBound struct {
	policy   *spillwayv1alpha1.DependencyPolicy
	consumer string
	spec     spillwayv1alpha1.Consumer
	bound    int32
	// share is the consumer's weight and the sum of the weights.
	weight, weights int64
}

// strictestBound is the lowest bound among the consumers of policies (not
// being deleted) that matches names, nil when none does. The bound is the
// consumer's share of the capacity, floor(capacity × weight / Σweights /
// slotsPerReplica), the one the controller applies while the dependency is
// healthy: the controller's own lower bounds during an outage and the ramp
// stay below it.
func strictestBound(policies []spillwayv1alpha1.DependencyPolicy, matches func(spillwayv1alpha1.Consumer) (string, bool)) *policyBound {
	var best *policyBound
	for i := range policies {
		pol := &policies[i]
		if !pol.DeletionTimestamp.IsZero() {
			continue
		}
		bounds := Bounds(int64(pol.Spec.Capacity.Concurrency), pol.Spec.Consumers)
		var weights int64
		for _, c := range pol.Spec.Consumers {
			weights += max(int64(c.Weight), 1)
		}
		for j, c := range pol.Spec.Consumers {
			name, ok := matches(c)
			if !ok || (best != nil && best.bound <= bounds[j]) {
				continue
			}
			best = &policyBound{policy: pol, consumer: name, spec: c, bound: bounds[j], weight: max(int64(c.Weight), 1), weights: weights}
		}
	}
	return best
}

// refusalMessage says why a request is refused and what to change instead,
// e.g. "spillway: mail/template-api serves 40 concurrent calls and
// render-workers makes 2 per replica, so at most 20 replicas (asked for 80);
// raise spec.capacity.concurrency of the DependencyPolicy if the dependency
// can serve more".
func refusalMessage(b *policyBound, a ask) string {
	slots := max(int64(b.spec.SlotsPerReplica), 1)
	share := ""
	if b.weights != b.weight {
		share = fmt.Sprintf(", %s's share is %d/%d of them", b.consumer, b.weight, b.weights)
	}
	asked := fmt.Sprintf("asked for %d", a.value)
	if a.field != "spec.replicas" && a.field != "kubectl scale" {
		asked = fmt.Sprintf("%s asks for %d", a.field, a.value)
	}
	msg := fmt.Sprintf("spillway: %s/%s serves %d concurrent calls%s and %s makes %d per replica, so at most %d replicas (%s); "+
		"raise spec.capacity.concurrency of the DependencyPolicy if the dependency can serve more",
		b.policy.Namespace, b.policy.Name, b.policy.Spec.Capacity.Concurrency, share, b.consumer, slots, b.bound, asked)
	if share != "" {
		msg += ", or the consumer's weight"
	}
	return msg
}

// fieldManagerOf is the field manager a request names in its options.
func fieldManagerOf(req admission.Request) string {
	var opts struct {
		FieldManager string `json:"fieldManager"`
	}
	if len(req.Options.Raw) == 0 || json.Unmarshal(req.Options.Raw, &opts) != nil {
		return ""
	}
	return opts.FieldManager
}

func decode(raw []byte) (map[string]any, error) {
	if len(raw) == 0 {
		return nil, nil
	}
	var m map[string]any
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, fmt.Errorf("failed to decode the object: %w", err)
	}
	return m, nil
}

// nestedInt reads a JSON number at path.
func nestedInt(obj map[string]any, path ...string) (int64, bool) {
	var cur any = obj
	for _, p := range path {
		m, ok := cur.(map[string]any)
		if !ok {
			return 0, false
		}
		cur = m[p]
	}
	f, ok := cur.(float64)
	return int64(f), ok
}

// pausedReplicas reads KEDA's paused-replicas annotation.
func pausedReplicas(obj map[string]any) (int64, bool) {
	md, _ := obj["metadata"].(map[string]any)
	ann, _ := md["annotations"].(map[string]any)
	s, ok := ann[AnnotationPausedReplicas].(string)
	if !ok {
		return 0, false
	}
	n, err := strconv.ParseInt(s, 10, 64)
	return n, err == nil
}
