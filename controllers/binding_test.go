package controllers

import (
	"encoding/json"
	"strings"
	"testing"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	. "github.com/onsi/gomega"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
)

func TestBounds(t *testing.T) {
	c := func(name string, weight, slots int32) spillwayv1alpha1.Consumer {
		return spillwayv1alpha1.Consumer{ScaledObjectName: name, Weight: weight, SlotsPerReplica: slots}
	}
	tests := []struct {
		name      string
		capacity  int64
		consumers []spillwayv1alpha1.Consumer
		want      []int32
	}{
		{name: "none", capacity: 40, consumers: nil, want: []int32{}},
		{name: "seed: one consumer, 2 slots per pod", capacity: 40, consumers: []spillwayv1alpha1.Consumer{c("render", 1, 2)}, want: []int32{20}},
		{name: "equal weights", capacity: 40, consumers: []spillwayv1alpha1.Consumer{c("a", 1, 1), c("b", 1, 1)}, want: []int32{20, 20}},
		{name: "weights 3:1", capacity: 40, consumers: []spillwayv1alpha1.Consumer{c("a", 3, 1), c("b", 1, 1)}, want: []int32{30, 10}},
		{name: "floors", capacity: 10, consumers: []spillwayv1alpha1.Consumer{c("a", 1, 1), c("b", 1, 1), c("c", 1, 1)}, want: []int32{3, 3, 3}},
		{name: "slots divide", capacity: 40, consumers: []spillwayv1alpha1.Consumer{c("a", 1, 3), c("b", 1, 1)}, want: []int32{6, 20}},
		{name: "at least one", capacity: 2, consumers: []spillwayv1alpha1.Consumer{c("a", 1, 4), c("b", 1, 1), c("c", 1, 1)}, want: []int32{1, 1, 1}},
		{name: "zero weight and slots count as one", capacity: 40, consumers: []spillwayv1alpha1.Consumer{c("a", 0, 0), c("b", 1, 1)}, want: []int32{20, 20}},
		{name: "large", capacity: 1 << 30, consumers: []spillwayv1alpha1.Consumer{c("a", 1<<30, 1)}, want: []int32{1 << 30}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			got := Bounds(tt.capacity, tt.consumers)
			g.Expect(got).To(Equal(tt.want))
			var total int64
			for i, b := range got {
				total += int64(b) * max(int64(tt.consumers[i].SlotsPerReplica), 1)
			}
			if tt.name != "at least one" {
				g.Expect(total).To(BeNumerically("<=", tt.capacity), "all consumers together fit the capacity")
			}
		})
	}
}

func TestDesiredReplicas(t *testing.T) {
	r := func(min, max *int32) Replicas { return Replicas{Min: min, Max: max} }
	i := ptr.To[int32]
	tests := []struct {
		name  string
		user  Replicas
		bound int32
		pin   *int32
		want  Replicas
	}{
		{name: "unset max: the bound below KEDA's 100", user: r(nil, nil), bound: 20, want: r(nil, i(20))},
		{name: "unset max stays unset above 100", user: r(nil, nil), bound: 200, want: r(nil, nil)},
		{name: "unset max at exactly 100 stays unset", user: r(nil, nil), bound: 100, want: r(nil, nil)},
		{name: "max lowered to the bound", user: r(i(2), i(80)), bound: 20, want: r(i(2), i(20))},
		{name: "a lower user max is kept: never raised", user: r(i(2), i(10)), bound: 20, want: r(i(2), i(10))},
		{name: "min above the bound is capped", user: r(i(30), i(80)), bound: 20, want: r(i(20), i(20))},
		{name: "pinned", user: r(i(2), i(80)), bound: 20, pin: i(7), want: r(i(7), i(20))},
		{name: "pin capped at the max", user: r(i(2), i(80)), bound: 20, pin: i(50), want: r(i(20), i(20))},
		{name: "pin never lowers the user's min", user: r(i(5), i(80)), bound: 20, pin: i(3), want: r(i(5), i(20))},
		{name: "pin with unset min", user: r(nil, nil), bound: 20, pin: i(4), want: r(i(4), i(20))},
		{name: "pin of zero replicas", user: r(nil, i(10)), bound: 20, pin: i(0), want: r(i(0), i(10))},
		{name: "pin with unset max above 100", user: r(nil, nil), bound: 500, pin: i(150), want: r(i(100), nil)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := DesiredReplicas(tt.user, tt.bound, tt.pin)
			if !got.Equal(tt.want) {
				t.Errorf("DesiredReplicas(%s, %d, %v) = %s, want %s", tt.user, tt.bound, tt.pin, got, tt.want)
			}
		})
	}
}

func TestReplicasAnnotationKeepsUnsetDistinct(t *testing.T) {
	g := NewWithT(t)
	r := Replicas{Max: ptr.To[int32](80)}
	g.Expect(r.marshal()).To(Equal(`{"min":null,"max":80}`))
	back, err := parseReplicas(r.marshal())
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(back.Equal(r)).To(BeTrue())
	_, err = parseReplicas("not json")
	g.Expect(err).To(HaveOccurred())
}

// managedBy is a managedFields entry of manager owning the replica fields
// named and the annotations named "ann:<key>".
func managedBy(manager string, op metav1.ManagedFieldsOperationType, fields ...string) metav1.ManagedFieldsEntry {
	spec := map[string]any{}
	ann := map[string]any{}
	for _, f := range fields {
		if k, ok := strings.CutPrefix(f, "ann:"); ok {
			ann["f:"+k] = map[string]any{}
			continue
		}
		spec["f:"+f] = map[string]any{}
	}
	set := map[string]any{"f:spec": spec}
	if len(ann) > 0 {
		set["f:metadata"] = map[string]any{"f:annotations": ann}
	}
	raw, _ := json.Marshal(set)
	return metav1.ManagedFieldsEntry{Manager: manager, Operation: op, APIVersion: "keda.sh/v1alpha1", FieldsType: "FieldsV1", FieldsV1: &metav1.FieldsV1{Raw: raw}}
}

func scaledObject(min, max *int32, ann map[string]string, managed ...metav1.ManagedFieldsEntry) *kedav1alpha1.ScaledObject {
	return &kedav1alpha1.ScaledObject{
		ObjectMeta: metav1.ObjectMeta{Name: "render", Namespace: "ns", Annotations: ann, ManagedFields: managed, ResourceVersion: "7"},
		Spec:       kedav1alpha1.ScaledObjectSpec{MinReplicaCount: min, MaxReplicaCount: max},
	}
}

func TestPlanBinding(t *testing.T) {
	i := ptr.To[int32]
	// The user's manager owns both fields before the first bind; Spillway's
	// forced apply of a lower max takes max from it (min, unchanged, is
	// shared), and the pin takes min too.
	user := managedBy("kubectl", metav1.ManagedFieldsOperationUpdate, "minReplicaCount", "maxReplicaCount")
	userBound := managedBy("kubectl", metav1.ManagedFieldsOperationUpdate, "minReplicaCount")
	userPinned := managedBy("kubectl", metav1.ManagedFieldsOperationUpdate, "scaleTargetRef")
	ours := func(fields ...string) metav1.ManagedFieldsEntry {
		return managedBy(FieldManager, metav1.ManagedFieldsOperationApply, fields...)
	}
	oursBound := ours("minReplicaCount", "maxReplicaCount", "ann:"+AnnotationOwner, "ann:"+AnnotationOriginalReplicas)
	oursPinned := ours("minReplicaCount", "maxReplicaCount", "ann:"+AnnotationOwner, "ann:"+AnnotationOriginalReplicas, "ann:"+AnnotationPinnedMinReplicas)
	bound := map[string]string{AnnotationOwner: "dep", AnnotationOriginalReplicas: `{"min":2,"max":80}`}
	withPin := map[string]string{AnnotationOwner: "dep", AnnotationOriginalReplicas: `{"min":2,"max":80}`, AnnotationPinnedMinReplicas: "7"}
	tests := []struct {
		name        string
		so          *kedav1alpha1.ScaledObject
		pinning     bool
		scaled      *int32
		wantDesired Replicas
		wantUser    Replicas
		wantAnn     map[string]string
		wantApply   bool
		wantAdopted string
		wantLegacy  bool
		wantRemove  []string
	}{
		{
			name:        "first bind records the user's replicas and the owner",
			so:          scaledObject(i(2), i(80), nil, user),
			wantDesired: Replicas{Min: i(2), Max: i(20)},
			wantUser:    Replicas{Min: i(2), Max: i(80)},
			wantAnn:     bound,
			wantApply:   true,
		},
		{
			name:        "first bind of unset replicas records nulls",
			so:          scaledObject(nil, nil, nil),
			wantDesired: Replicas{Max: i(20)},
			wantUser:    Replicas{},
			wantAnn:     map[string]string{AnnotationOwner: "dep", AnnotationOriginalReplicas: `{"min":null,"max":null}`},
			wantApply:   true,
		},
		{
			name:        "bound and owned: nothing to do",
			so:          scaledObject(i(2), i(20), bound, userBound, oursBound),
			wantDesired: Replicas{Min: i(2), Max: i(20)},
			wantUser:    Replicas{Min: i(2), Max: i(80)},
			wantAnn:     bound,
		},
		{
			name:        "bound, the annotations owned by the legacy metadata manager: dropped and applied",
			so:          scaledObject(i(2), i(20), bound, userBound, ours("minReplicaCount", "maxReplicaCount"), managedBy(MetadataFieldOwner, metav1.ManagedFieldsOperationUpdate, "ann:"+AnnotationOwner, "ann:"+AnnotationOriginalReplicas)),
			wantDesired: Replicas{Min: i(2), Max: i(20)},
			wantUser:    Replicas{Min: i(2), Max: i(80)},
			wantAnn:     bound,
			wantApply:   true,
			wantLegacy:  true,
		},
		{
			name:        "outage over, the pin annotation owned by the legacy metadata manager: removed by patch",
			so:          scaledObject(i(7), i(20), withPin, userPinned, ours("minReplicaCount", "maxReplicaCount"), managedBy(MetadataFieldOwner, metav1.ManagedFieldsOperationUpdate, "ann:"+AnnotationOwner, "ann:"+AnnotationOriginalReplicas, "ann:"+AnnotationPinnedMinReplicas)),
			wantDesired: Replicas{Min: i(2), Max: i(20)},
			wantUser:    Replicas{Min: i(2), Max: i(80)},
			wantAnn:     bound,
			wantApply:   true,
			wantLegacy:  true,
			wantRemove:  []string{AnnotationPinnedMinReplicas},
		},
		{
			name:        "the user changed max: it becomes the user's",
			so:          scaledObject(i(2), i(60), bound, managedBy("kubectl", metav1.ManagedFieldsOperationUpdate, "maxReplicaCount"), ours("minReplicaCount", "ann:"+AnnotationOwner, "ann:"+AnnotationOriginalReplicas)),
			wantDesired: Replicas{Min: i(2), Max: i(20)},
			wantUser:    Replicas{Min: i(2), Max: i(60)},
			wantAnn:     map[string]string{AnnotationOwner: "dep", AnnotationOriginalReplicas: `{"min":2,"max":60}`},
			wantApply:   true,
			wantAdopted: "maxReplicaCount",
		},
		{
			name:        "the user applied the bound as max: co-owned, it becomes the user's",
			so:          scaledObject(i(2), i(20), bound, managedBy("argocd", metav1.ManagedFieldsOperationApply, "minReplicaCount", "maxReplicaCount"), oursBound),
			wantDesired: Replicas{Min: i(2), Max: i(20)},
			wantUser:    Replicas{Min: i(2), Max: i(20)},
			wantAnn:     map[string]string{AnnotationOwner: "dep", AnnotationOriginalReplicas: `{"min":2,"max":20}`},
			wantApply:   true,
			wantAdopted: "maxReplicaCount",
		},
		{
			name:        "a co-owned min at the recorded value: nothing to adopt",
			so:          scaledObject(i(2), i(20), bound, managedBy("argocd", metav1.ManagedFieldsOperationApply, "minReplicaCount"), oursBound),
			wantDesired: Replicas{Min: i(2), Max: i(20)},
			wantUser:    Replicas{Min: i(2), Max: i(80)},
			wantAnn:     bound,
		},
		{
			name:        "a co-owned min at the pinned value is not the user's",
			so:          scaledObject(i(7), i(20), withPin, userPinned, managedBy("argocd", metav1.ManagedFieldsOperationApply, "minReplicaCount"), oursPinned),
			pinning:     true,
			wantDesired: Replicas{Min: i(7), Max: i(20)},
			wantUser:    Replicas{Min: i(2), Max: i(80)},
			wantAnn:     withPin,
		},
		{
			name:        "outage begins: pin the scaled replicas",
			so:          scaledObject(i(2), i(20), bound, userBound, oursBound),
			pinning:     true,
			scaled:      i(7),
			wantDesired: Replicas{Min: i(7), Max: i(20)},
			wantUser:    Replicas{Min: i(2), Max: i(80)},
			wantAnn:     withPin,
			wantApply:   true,
		},
		{
			name:        "the pin annotation wins over a new reading",
			so:          scaledObject(i(7), i(20), withPin, userPinned, oursPinned),
			pinning:     true,
			scaled:      i(12),
			wantDesired: Replicas{Min: i(7), Max: i(20)},
			wantUser:    Replicas{Min: i(2), Max: i(80)},
			wantAnn:     withPin,
		},
		{
			name:        "outage over: the user's min comes back, the pin annotation goes",
			so:          scaledObject(i(7), i(20), withPin, userPinned, oursPinned),
			wantDesired: Replicas{Min: i(2), Max: i(20)},
			wantUser:    Replicas{Min: i(2), Max: i(80)},
			wantAnn:     bound,
			wantApply:   true,
		},
		{
			name:     "outage over with an unset min: min is dropped from the apply",
			so:       scaledObject(i(7), i(20), map[string]string{AnnotationOwner: "dep", AnnotationOriginalReplicas: `{"min":null,"max":null}`, AnnotationPinnedMinReplicas: "7"}, oursPinned),
			wantUser: Replicas{},
			// min unset, max at the bound
			wantDesired: Replicas{Max: i(20)},
			wantAnn:     map[string]string{AnnotationOwner: "dep", AnnotationOriginalReplicas: `{"min":null,"max":null}`},
			wantApply:   true,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			b := planBinding("dep", soAutoscaler{tt.so}, 20, tt.pinning, tt.scaled)
			g.Expect(b.Desired.Equal(tt.wantDesired)).To(BeTrue(), "desired %s", b.Desired)
			g.Expect(b.User.Equal(tt.wantUser)).To(BeTrue(), "user %s", b.User)
			g.Expect(b.Annotations).To(Equal(tt.wantAnn))
			g.Expect(b.Apply).To(Equal(tt.wantApply))
			g.Expect(b.Adopted).To(Equal(tt.wantAdopted))
			g.Expect(b.DropLegacy).To(Equal(tt.wantLegacy))
			g.Expect(b.Remove).To(Equal(tt.wantRemove))
		})
	}
}

func TestPlanRelease(t *testing.T) {
	i := ptr.To[int32]
	ours := managedBy(FieldManager, metav1.ManagedFieldsOperationApply, "minReplicaCount", "maxReplicaCount")
	rec := map[string]string{AnnotationOwner: "dep", AnnotationOriginalReplicas: `{"min":null,"max":80}`, AnnotationPinnedMinReplicas: "7"}
	tests := []struct {
		name string
		so   *kedav1alpha1.ScaledObject
		want *Replicas
	}{
		{name: "the record", so: scaledObject(i(7), i(20), rec, ours), want: &Replicas{Max: i(80)}},
		{name: "no record: the live values stay", so: scaledObject(i(7), i(20), nil, ours), want: nil},
		{name: "a change not yet recorded", so: scaledObject(i(7), i(60), rec, managedBy(FieldManager, metav1.ManagedFieldsOperationApply, "minReplicaCount"), managedBy("kubectl", metav1.ManagedFieldsOperationUpdate, "maxReplicaCount")), want: &Replicas{Max: i(60)}},
		{name: "a co-owned max not yet recorded", so: scaledObject(i(7), i(20), rec, ours, managedBy("argocd", metav1.ManagedFieldsOperationApply, "maxReplicaCount")), want: &Replicas{Max: i(20)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := planRelease(soAutoscaler{tt.so})
			if (got == nil) != (tt.want == nil) || (got != nil && !got.Equal(*tt.want)) {
				t.Errorf("planRelease = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestLetGoPatch(t *testing.T) {
	g := NewWithT(t)
	creator := managedBy("kubectl", metav1.ManagedFieldsOperationUpdate, "scaleTargetRef")
	ours := managedBy(FieldManager, metav1.ManagedFieldsOperationApply, "minReplicaCount", "maxReplicaCount", "ann:"+AnnotationOwner)
	legacy := managedBy(MetadataFieldOwner, metav1.ManagedFieldsOperationUpdate, "maxReplicaCount")
	data, err := letGoPatch("7", []metav1.ManagedFieldsEntry{creator, ours, legacy})
	g.Expect(err).NotTo(HaveOccurred())
	var patch struct {
		Metadata struct {
			ResourceVersion string                      `json:"resourceVersion"`
			Annotations     map[string]*string          `json:"annotations"`
			ManagedFields   []metav1.ManagedFieldsEntry `json:"managedFields"`
		} `json:"metadata"`
		Spec map[string]any `json:"spec"`
	}
	g.Expect(json.Unmarshal(data, &patch)).To(Succeed())
	g.Expect(patch.Metadata.ResourceVersion).To(Equal("7"), "the patch fails if the object changed")
	g.Expect(patch.Metadata.Annotations).To(HaveLen(3))
	for _, v := range patch.Metadata.Annotations {
		g.Expect(v).To(BeNil())
	}
	g.Expect(patch.Metadata.ManagedFields).To(ConsistOf(creator), "only Spillway's entries are dropped")
	g.Expect(patch.Spec).To(BeNil(), "no field but metadata changes")

	// Only Spillway ever managed fields: the list is cleared, not omitted.
	data, err = letGoPatch("7", []metav1.ManagedFieldsEntry{ours})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(string(data)).To(ContainSubstring(`"managedFields":[{}]`))

	// Nothing of Spillway's in managedFields: it is not sent.
	data, err = letGoPatch("7", []metav1.ManagedFieldsEntry{creator})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(string(data)).NotTo(ContainSubstring("managedFields"))
}

func TestCleanupPatch(t *testing.T) {
	g := NewWithT(t)
	creator := managedBy("kubectl", metav1.ManagedFieldsOperationUpdate, "scaleTargetRef")
	legacy := managedBy(MetadataFieldOwner, metav1.ManagedFieldsOperationUpdate, "ann:"+AnnotationPinnedMinReplicas)
	entries := []metav1.ManagedFieldsEntry{creator, legacy}

	data, err := cleanupPatch(binding{}, "7", entries)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(data).To(BeNil(), "nothing to do")

	data, err = cleanupPatch(binding{DropLegacy: true, Remove: []string{AnnotationPinnedMinReplicas}}, "7", entries)
	g.Expect(err).NotTo(HaveOccurred())
	var patch struct {
		Metadata struct {
			ResourceVersion string                      `json:"resourceVersion"`
			Annotations     map[string]*string          `json:"annotations"`
			ManagedFields   []metav1.ManagedFieldsEntry `json:"managedFields"`
		} `json:"metadata"`
		Spec map[string]any `json:"spec"`
	}
	g.Expect(json.Unmarshal(data, &patch)).To(Succeed())
	g.Expect(patch.Metadata.ResourceVersion).To(Equal("7"))
	g.Expect(patch.Metadata.Annotations).To(Equal(map[string]*string{AnnotationPinnedMinReplicas: nil}))
	g.Expect(patch.Metadata.ManagedFields).To(ConsistOf(creator))
	g.Expect(patch.Spec).To(BeNil())

	data, err = cleanupPatch(binding{Remove: []string{AnnotationPinnedMinReplicas}}, "7", entries)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(string(data)).NotTo(ContainSubstring("managedFields"), "the entries stay without DropLegacy")
}
