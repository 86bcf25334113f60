package policy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"

	apiextensionsinternal "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	structuralschema "k8s.io/apiextensions-apiserver/pkg/apiserver/schema"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/cel"
	structuraldefaulting "k8s.io/apiextensions-apiserver/pkg/apiserver/schema/defaulting"
	structurallisttype "k8s.io/apiextensions-apiserver/pkg/apiserver/schema/listtype"
	schemaobjectmeta "k8s.io/apiextensions-apiserver/pkg/apiserver/schema/objectmeta"
	structuralpruning "k8s.io/apiextensions-apiserver/pkg/apiserver/schema/pruning"
	apiservervalidation "k8s.io/apiextensions-apiserver/pkg/apiserver/validation"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	"sigs.k8s.io/yaml"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/config/crd"
)

// schema is the DependencyPolicy schema in the three forms the API server
// uses: structural (pruning and defaulting), OpenAPI (validation) and CEL
// (x-kubernetes-validations).
type schema struct {
	structural *structuralschema.Structural
	openAPI    apiservervalidation.SchemaValidator
	cel        *cel.Validator
}

// loadSchema builds the schema once from the embedded CRD.
var loadSchema = sync.OnceValues(func() (*schema, error) {
	return newSchema(crd.DependencyPolicyCRD, spillwayv1alpha1.GroupVersion.Version)
})

// newSchema builds the schema of version from a CRD manifest, the way the
// API server's custom resource handler does.
func newSchema(crdYAML []byte, version string) (*schema, error) {
	var def apiextensionsv1.CustomResourceDefinition
	if err := yaml.UnmarshalStrict(crdYAML, &def); err != nil {
		return nil, fmt.Errorf("failed to decode the DependencyPolicy CRD: %w", err)
	}
	var validationV1 *apiextensionsv1.CustomResourceValidation
	for i := range def.Spec.Versions {
		if def.Spec.Versions[i].Name == version {
			validationV1 = def.Spec.Versions[i].Schema
		}
	}
	if validationV1 == nil || validationV1.OpenAPIV3Schema == nil {
		return nil, fmt.Errorf("the DependencyPolicy CRD has no schema for version %s", version)
	}
	internal := &apiextensionsinternal.CustomResourceValidation{}
	if err := apiextensionsv1.Convert_v1_CustomResourceValidation_To_apiextensions_CustomResourceValidation(validationV1, internal, nil); err != nil {
		return nil, fmt.Errorf("failed to convert the DependencyPolicy schema: %w", err)
	}
	structural, err := structuralschema.NewStructural(internal.OpenAPIV3Schema)
	if err != nil {
		return nil, fmt.Errorf("the DependencyPolicy schema is not structural: %w", err)
	}
	if err := structuraldefaulting.PruneDefaults(structural); err != nil {
		return nil, fmt.Errorf("failed to prune the DependencyPolicy schema's defaults: %w", err)
	}
	openAPI, _, err := apiservervalidation.NewSchemaValidator(internal.OpenAPIV3Schema)
	if err != nil {
		return nil, fmt.Errorf("failed to build the DependencyPolicy validator: %w", err)
	}
	return &schema{
		structural: structural,
		openAPI:    openAPI,
		cel:        cel.NewValidator(structural, true, celconfig.PerCallLimit),
	}, nil
}

// LoadFile reads a DependencyPolicy manifest from path; see Load.
func LoadFile(path string) (*spillwayv1alpha1.DependencyPolicy, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("failed to read policy: %w", err)
	}
	p, err := Load(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return p, nil
}

// Load decodes a DependencyPolicy manifest, YAML or JSON, the very file a user
// would `kubectl apply`, and treats it as the API server would: unknown fields
// are rejected (as kubectl's strict field validation does), the CRD's defaults
// are applied with structural defaulting, and the object is validated against
// the CRD's OpenAPI schema, its list types and its CEL rules
// (x-kubernetes-validations). Finally FromSpec checks that the controller can
// use the spec. Every error names the field, for example
// "spec.ramp.steps: Invalid value: ...".
//
// The input must hold exactly one YAML document.
func Load(data []byte) (*spillwayv1alpha1.DependencyPolicy, error) {
	s, err := loadSchema()
	if err != nil {
		return nil, err
	}
	obj, err := decodeObject(data)
	if err != nil {
		return nil, err
	}
	if err := checkType(obj); err != nil {
		return nil, err
	}
	if err := coerce(obj, s); err != nil {
		return nil, err
	}
	structuraldefaulting.Default(obj, s.structural)
	if errs := s.validate(obj); len(errs) > 0 {
		return nil, fmt.Errorf("invalid DependencyPolicy: %w", errs.ToAggregate())
	}
	var p spillwayv1alpha1.DependencyPolicy
	if err := toTyped(obj, &p); err != nil {
		return nil, err
	}
	if _, err := FromSpec(p.Spec); err != nil {
		return nil, fmt.Errorf("invalid DependencyPolicy: spec.%w", err)
	}
	return &p, nil
}

// decodeObject reads the single YAML (or JSON) document in data into the
// unstructured form the API server works on: integers as int64, other numbers
// as float64.
func decodeObject(data []byte) (map[string]interface{}, error) {
	reader := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var docs [][]byte
	for {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("failed to read YAML: %w", err)
		}
		if len(bytes.TrimSpace(stripComments(doc))) > 0 {
			docs = append(docs, doc)
		}
	}
	if len(docs) != 1 {
		return nil, fmt.Errorf("expected exactly one YAML document, found %d", len(docs))
	}
	js, err := yaml.YAMLToJSONStrict(docs[0])
	if err != nil {
		return nil, fmt.Errorf("failed to parse YAML: %w", err)
	}
	var obj map[string]interface{}
	if err := utiljson.Unmarshal(js, &obj); err != nil {
		return nil, fmt.Errorf("failed to parse YAML: expected an object: %w", err)
	}
	if obj == nil {
		return nil, errors.New("failed to parse YAML: the document is empty")
	}
	return obj, nil
}

// checkType requires apiVersion spillway.dev/v1alpha1 and kind DependencyPolicy.
func checkType(obj map[string]interface{}) error {
	var errs field.ErrorList
	want := spillwayv1alpha1.GroupVersion.String()
	if v, _ := obj["apiVersion"].(string); v != want {
		errs = append(errs, field.NotSupported(field.NewPath("apiVersion"), obj["apiVersion"], []string{want}))
	}
	if k, _ := obj["kind"].(string); k != spillwayv1alpha1.DependencyPolicyKind {
		errs = append(errs, field.NotSupported(field.NewPath("kind"), obj["kind"], []string{spillwayv1alpha1.DependencyPolicyKind}))
	}
	if len(errs) > 0 {
		return fmt.Errorf("not a DependencyPolicy: %w", errs.ToAggregate())
	}
	return nil
}

// coerce prunes unknown fields and nulls like the API server's decoder, but
// reports unknown fields as errors, as kubectl's default strict field
// validation does, instead of dropping them silently.
func coerce(obj map[string]interface{}, s *schema) error {
	_, _, unknownMeta, err := schemaobjectmeta.GetObjectMetaWithOptions(obj, schemaobjectmeta.ObjectMetaOptions{ReturnUnknownFieldPaths: true})
	if err != nil {
		return fmt.Errorf("invalid DependencyPolicy: %w", err)
	}
	unknown := append(unknownMeta, structuralpruning.PruneWithOptions(obj, s.structural, true,
		structuralschema.UnknownFieldPathOptions{TrackUnknownFieldPaths: true})...)
	if len(unknown) > 0 {
		var errs field.ErrorList
		for _, path := range unknown {
			errs = append(errs, field.Forbidden(dottedPath(path), "unknown field"))
		}
		return fmt.Errorf("invalid DependencyPolicy: %w", errs.ToAggregate())
	}
	structuraldefaulting.PruneNonNullableNullsWithoutDefaults(obj, s.structural)
	return nil
}

// validate runs the checks of the API server's create strategy: metadata,
// OpenAPI schema, list types and, when nothing blocking was found, CEL.
func (s *schema) validate(obj map[string]interface{}) field.ErrorList {
	errs := validateMetadata(obj)
	errs = append(errs, apiservervalidation.ValidateCustomResource(nil, obj, s.openAPI)...)
	errs = append(errs, structurallisttype.ValidateListSetsAndMaps(nil, s.structural, obj)...)
	if blocking(errs) {
		return errs
	}
	celErrs, _ := s.cel.Validate(context.Background(), nil, s.structural, obj, nil, celconfig.RuntimeCELCostBudget)
	return append(errs, celErrs...)
}

// validateMetadata requires a name that is a DNS subdomain, and a namespace,
// when one is given, that is a DNS label.
func validateMetadata(obj map[string]interface{}) field.ErrorList {
	meta, _ := obj["metadata"].(map[string]interface{})
	path := field.NewPath("metadata")
	var errs field.ErrorList
	name, _ := meta["name"].(string)
	if name == "" {
		errs = append(errs, field.Required(path.Child("name"), "name is required"))
	} else {
		for _, msg := range validation.IsDNS1123Subdomain(name) {
			errs = append(errs, field.Invalid(path.Child("name"), name, msg))
		}
	}
	if ns, _ := meta["namespace"].(string); ns != "" {
		for _, msg := range validation.IsDNS1123Label(ns) {
			errs = append(errs, field.Invalid(path.Child("namespace"), ns, msg))
		}
	}
	return errs
}

// blocking reports whether errs stop the API server from running CEL rules,
// which would otherwise see values of the wrong type.
func blocking(errs field.ErrorList) bool {
	for _, err := range errs {
		switch err.Type {
		case field.ErrorTypeNotSupported, field.ErrorTypeRequired, field.ErrorTypeTooLong,
			field.ErrorTypeTooMany, field.ErrorTypeTypeInvalid:
			return true
		}
	}
	return false
}

// toTyped converts the defaulted, validated object into the Go type.
func toTyped(obj map[string]interface{}, p *spillwayv1alpha1.DependencyPolicy) error {
	js, err := json.Marshal(obj)
	if err != nil {
		return fmt.Errorf("failed to encode DependencyPolicy: %w", err)
	}
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.DisallowUnknownFields()
	if err := dec.Decode(p); err != nil {
		return fmt.Errorf("failed to decode DependencyPolicy: %w", err)
	}
	return nil
}

// dottedPath turns a path such as "spec.consumers[0].foo" into a field.Path
// that prints the same way.
func dottedPath(path string) *field.Path {
	parts := strings.Split(path, ".")
	return field.NewPath(parts[0], parts[1:]...)
}

// stripComments drops YAML comment lines, so that a document holding only
// comments counts as empty.
func stripComments(doc []byte) []byte {
	var out []byte
	for _, line := range bytes.Split(doc, []byte("\n")) {
		if !strings.HasPrefix(strings.TrimSpace(string(line)), "#") {
			out = append(out, line...)
			out = append(out, '\n')
		}
	}
	return out
}
