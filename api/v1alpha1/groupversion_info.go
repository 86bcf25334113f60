// Package v1alpha1 contains the spillway.dev/v1alpha1 API: the DependencyPolicy
// kind, one object per dependency that a fleet of workers calls.
//
// +kubebuilder:object:generate=true
// +groupName=spillway.dev
package v1alpha1

import (
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/scheme"
)

var (
	// GroupVersion is the group and version used to register these objects.
	GroupVersion = schema.GroupVersion{Group: "spillway.dev", Version: "v1alpha1"}

	// SchemeBuilder adds the Go types to a runtime.Scheme.
	SchemeBuilder = &scheme.Builder{GroupVersion: GroupVersion}

	// AddToScheme adds the types in this group-version to the given scheme.
	AddToScheme = SchemeBuilder.AddToScheme
)
