// Package crd embeds the CustomResourceDefinitions generated into bases/, so
// that tools such as `spillway simulate` default and validate a manifest with
// exactly the schema the API server serves.
package crd

import _ "embed"

// DependencyPolicyCRD is the generated CustomResourceDefinition of
// spillway.dev/v1alpha1 DependencyPolicy, as YAML.
//
//go:embed bases/spillway.dev_dependencypolicies.yaml
var DependencyPolicyCRD []byte
