package controllers

import (
	"encoding/json"
	"fmt"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
)

// This file plans, without I/O, what Spillway writes to a workload that no
// autoscaler scales (a scaleTargetRef consumer: a Deployment, StatefulSet,
// ReplicaSet or custom resource with a scale subresource): its replicas,
// lowered to the bound through the scale subresource (planWorkload), the
// user's own replicas to put back (planWorkloadRelease), and the refusal of a
// workload an autoscaler already scales (workloadRefusal).
// workload_consumers.go does the reads and writes.

// LabelBoundedBy, on a workload without an autoscaler that a policy bounds,
// names the policy. The controller sets it (with FieldManager) and removes it
// when it lets go; the admission webhook's objectSelector matches it, so the
// API server calls the webhook for the objects Spillway bounds and no others.
const LabelBoundedBy = "spillway.dev/bounded-by"

// workloadRef names a consumer's workload in the policy's namespace. The
// apiVersion is never empty: an unset one is apps/v1.
type workloadRef struct {
	APIVersion, Kind, Name string
}

// targetRef is the workloadRef of an apiVersion, kind and name as a
// scaleTargetRef gives them: an unset apiVersion is apps/v1 and an unset kind
// Deployment, as KEDA defaults them.
func targetRef(apiVersion, kind, name string) workloadRef {
	if apiVersion == "" {
		apiVersion = "apps/v1"
	}
	if kind == "" {
		kind = "Deployment"
	}
	return workloadRef{APIVersion: apiVersion, Kind: kind, Name: name}
}

// workloadOf is the workload a scaleTargetRef consumer names.
func workloadOf(ref *spillwayv1alpha1.ScaleTargetRef) workloadRef {
	return targetRef(ref.APIVersion, ref.Kind, ref.Name)
}

// String names the workload in conditions: "Deployment/render-workers".
func (w workloadRef) String() string { return w.Kind + "/" + w.Name }

// describe names the workload in messages: "Deployment render (apps/v1)".
func (w workloadRef) describe() string {
	return fmt.Sprintf("%s %s (%s)", w.Kind, w.Name, w.APIVersion)
}

// group is the workload's API group ("apps"), "" when the apiVersion cannot
// be parsed.
func (w workloadRef) group() string {
	gv, err := schema.ParseGroupVersion(w.APIVersion)
	if err != nil {
		return ""
	}
	return gv.Group
}

// sameWorkload reports whether a and b name the same object: the same group,
// kind and name (the version does not matter).
func sameWorkload(a, b workloadRef) bool {
	return a.group() == b.group() && a.Kind == b.Kind && a.Name == b.Name
}

// spec is the workload as a ScaleTargetRef, for status.
func (w workloadRef) spec() spillwayv1alpha1.ScaleTargetRef {
	return spillwayv1alpha1.ScaleTargetRef{APIVersion: w.APIVersion, Kind: w.Kind, Name: w.Name}
}

// autoscalerOf names an autoscaler that scales a workload.
type autoscalerOf struct {
	Kind   *autoscalerKind
	Name   string
	Target workloadRef
}

// workloadRefusal is why Spillway does not bound w, or nil when it may: an
// autoscaler (an HPA or a ScaledObject) scales it, and would undo any
// replicas Spillway set. Such a workload's autoscaler is the consumer to name.
// KEDA's own HPAs (keda-hpa-*) are skipped: the ScaledObject is named.
func workloadRefusal(w workloadRef, autoscalers []autoscalerOf) *consumerResult {
	for _, a := range autoscalers {
		if !sameWorkload(w, a.Target) {
			continue
		}
		field := "scaledObjectName"
		reason := ReasonOwnedByScaledObject
		if a.Kind == hpaKind {
			field = "horizontalPodAutoscalerName"
			reason = ReasonOwnedByHorizontalPodAutoscaler
		}
		return &consumerResult{
			Reason: reason,
			Message: fmt.Sprintf("the %s is scaled by %s %s, which would undo any replicas Spillway sets: "+
				"name the %s instead (%s: %s)", w.Kind, a.Kind.Kind, a.Name, a.Kind.Kind, field, a.Name),
		}
	}
	return nil
}

// workloadRecord is the AnnotationOriginalReplicas annotation of a
// workload: its user's own replicas and the replicas Spillway last set,
// {"replicas":80,"applied":20}. A value other than Applied on the workload
// was set by someone else since: the user's new replicas.
type workloadRecord struct {
	Replicas int32  `json:"replicas"`
	Applied  *int32 `json:"applied,omitempty"`
}

// parseWorkloadRecord reads a workload's AnnotationOriginalReplicas.
func parseWorkloadRecord(s string) (workloadRecord, error) {
	var r struct {
		Replicas *int32 `json:"replicas"`
		Applied  *int32 `json:"applied"`
	}
	if err := json.Unmarshal([]byte(s), &r); err != nil {
		return workloadRecord{}, fmt.Errorf("failed to parse %q: %w", s, err)
	}
	if r.Replicas == nil || *r.Replicas < 0 {
		return workloadRecord{}, fmt.Errorf("failed to parse %q: no replicas", s)
	}
	return workloadRecord{Replicas: *r.Replicas, Applied: r.Applied}, nil
}

// marshal is the AnnotationOriginalReplicas of the record.
func (r workloadRecord) marshal() string {
	b, _ := json.Marshal(r) // an int32 and a pointer to one always marshal
	return string(b)
}

// workloadBinding is what planWorkload decided for one workload.
type workloadBinding struct {
	// Live is the workload's replicas now (its scale's spec.replicas);
	// Desired what they should be: min(User, bound).
	Live, Desired int32
	// User is the user's replicas: recorded, or the live ones when the user
	// changed them since.
	User int32
	// Adopted: the user changed the replicas since they were recorded.
	Adopted bool
	// Annotations and Labels are what FieldManager applies.
	Annotations, Labels map[string]string
	// Apply: the annotations or the label must be applied (before the
	// replicas are scaled, so that the user's are recorded first).
	Apply bool
	// Scale: the replicas must be set to Desired through the scale
	// subresource.
	Scale bool
}

// planWorkload decides how policyName bounds a workload whose metadata has
// annotations, labels and managedFields entries and whose scale says live
// replicas, to bound.
//
// The user's replicas are the recorded annotation, or the live ones before the
// first change. They are the live ones again when they differ from the record
// and someone else set them since (see userWorkloadReplicas): a person's
// kubectl scale, a GitOps sync of a new manifest. Spillway only ever lowers
// replicas, never raises them above what the user last set. The record, with
// the replicas about to be set, is applied before the scale.
func planWorkload(policyName string, annotations, labels map[string]string, entries []metav1.ManagedFieldsEntry, live, bound int32) workloadBinding {
	b := workloadBinding{Live: live, User: live}
	if s, ok := annotations[AnnotationOriginalReplicas]; ok {
		if rec, err := parseWorkloadRecord(s); err == nil {
			b.User, b.Adopted = userWorkloadReplicas(rec, live, entries)
		}
	}
	b.Desired = min(b.User, bound)
	b.Annotations = map[string]string{
		AnnotationOwner:            policyName,
		AnnotationOriginalReplicas: workloadRecord{Replicas: b.User, Applied: ptrTo(b.Desired)}.marshal(),
	}
	b.Labels = map[string]string{LabelBoundedBy: policyName}
	b.Apply = annotations[AnnotationOwner] != policyName ||
		annotations[AnnotationOriginalReplicas] != b.Annotations[AnnotationOriginalReplicas] ||
		labels[LabelBoundedBy] != policyName
	b.Scale = live != b.Desired
	return b
}

// planWorkloadRelease is the replicas a workload gets back when Spillway lets
// go of it: the record, or the live replicas when the user changed them since;
// nil when nothing was recorded (or the record cannot be read), and then the
// live replicas stay.
func planWorkloadRelease(annotations map[string]string, entries []metav1.ManagedFieldsEntry, live int32) *int32 {
	rec, err := parseWorkloadRecord(annotations[AnnotationOriginalReplicas])
	if err != nil {
		return nil
	}
	u, _ := userWorkloadReplicas(rec, live, entries)
	return &u
}

// userWorkloadReplicas is the user's replicas of a workload whose record is
// rec and whose live replicas are live, and whether they are the live ones.
// They are when they differ from the record and
//
//   - they are not what Spillway last set (rec.Applied): someone else set
//     them since. managedFields cannot say so alone: the API server does not
//     record who writes a scale subresource while nobody owns spec.replicas,
//     as after Spillway let go of the workload once; or
//   - another manager owns spec.replicas: a GitOps tool applied exactly the
//     value Spillway set (Git says 20 while the bound is 20).
func userWorkloadReplicas(rec workloadRecord, live int32, entries []metav1.ManagedFieldsEntry) (int32, bool) {
	if live == rec.Replicas {
		return rec.Replicas, false
	}
	changed := rec.Applied == nil || live != *rec.Applied
	if _, other := replicasOwnership(entries); changed || other {
		return live, true
	}
	return rec.Replicas, false
}

// replicasOwnership reads who owns a workload's spec.replicas: FieldManager
// (its scale subresource updates) and any other manager. Status entries and
// entries that cannot be read are skipped.
func replicasOwnership(entries []metav1.ManagedFieldsEntry) (own, other bool) {
	for _, e := range entries {
		if e.Subresource == "status" || e.FieldsV1 == nil {
			continue
		}
		set, err := parseFieldsV1(e.FieldsV1.Raw)
		if err != nil || !set.has("f:spec", "f:replicas") {
			continue
		}
		if e.Manager == FieldManager {
			own = true
		} else {
			other = true
		}
	}
	return own, other
}

// workloadsOf is the workloads pol's spec names, in order.
func workloadsOf(pol *spillwayv1alpha1.DependencyPolicy) []workloadRef {
	var out []workloadRef
	for _, c := range pol.Spec.Consumers {
		if c.ScaleTargetRef != nil {
			out = append(out, workloadOf(c.ScaleTargetRef))
		}
	}
	return out
}

// compareWorkloads orders workloads by kind, then name.
func compareWorkloads(a, b workloadRef) int {
	if c := strings.Compare(a.Kind, b.Kind); c != 0 {
		return c
	}
	if c := strings.Compare(a.Name, b.Name); c != 0 {
		return c
	}
	return strings.Compare(a.APIVersion, b.APIVersion)
}
