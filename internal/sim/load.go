package sim

import (
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/policy"
)

// builtins holds the built-in scenarios, in the format users write.
//
//go:embed scenarios
var builtins embed.FS

// scenarioFile is the file format: a Scenario plus its DependencyPolicy,
// either inline under policy or as a path under policyFile, relative to the
// scenario file.
type scenarioFile struct {
	Scenario
	PolicyFile string          `json:"policyFile,omitempty"`
	Policy     json.RawMessage `json:"policy,omitempty"`
}

// BuiltinNames returns the names of the built-in scenarios, sorted.
func BuiltinNames() []string {
	entries, err := builtins.ReadDir("scenarios")
	if err != nil {
		return nil
	}
	var names []string
	for _, e := range entries {
		if !e.IsDir() && strings.HasSuffix(e.Name(), ".yaml") {
			names = append(names, strings.TrimSuffix(e.Name(), ".yaml"))
		}
	}
	slices.Sort(names)
	return names
}

// Builtin returns the built-in scenario called name.
func Builtin(name string) (*Scenario, error) {
	if !slices.Contains(BuiltinNames(), name) {
		return nil, fmt.Errorf("unknown scenario %q (built in: %s)", name, strings.Join(BuiltinNames(), ", "))
	}
	data, err := builtins.ReadFile(path.Join("scenarios", name+".yaml"))
	if err != nil {
		return nil, fmt.Errorf("built-in scenario %s: %w", name, err)
	}
	read := func(rel string) ([]byte, error) { return fs.ReadFile(builtins, path.Join("scenarios", rel)) }
	sc, err := ParseScenario(data, read)
	if err != nil {
		return nil, fmt.Errorf("built-in scenario %s: %w", name, err)
	}
	return sc, nil
}

// LoadScenarioFile reads a scenario file; its policyFile, if any, is read
// relative to the scenario file's directory.
func LoadScenarioFile(file string) (*Scenario, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("failed to read scenario: %w", err)
	}
	dir := filepath.Dir(file)
	read := func(rel string) ([]byte, error) {
		if !filepath.IsAbs(rel) {
			rel = filepath.Join(dir, rel)
		}
		return os.ReadFile(rel)
	}
	sc, err := ParseScenario(data, read)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	return sc, nil
}

// ParseScenario decodes a scenario file (YAML, unknown fields rejected),
// loads its DependencyPolicy with policy.Load (readFile, which may be nil,
// resolves policyFile), applies the defaults and validates everything but the
// presence of a policy: a scenario without one is valid here, and Run
// requires the caller to have set Scenario.Policy.
func ParseScenario(data []byte, readFile func(string) ([]byte, error)) (*Scenario, error) {
	var f scenarioFile
	if err := yaml.UnmarshalStrict(data, &f); err != nil {
		// A duration that does not parse fails inside metav1.Duration's
		// decoder, whose error does not say where: find the field.
		var doc any
		if yaml.Unmarshal(data, &doc) == nil {
			if errs := durationErrors(doc, reflect.TypeFor[scenarioFile](), ""); len(errs) > 0 {
				return nil, fmt.Errorf("invalid scenario: %w", errors.Join(errs...))
			}
		}
		return nil, fmt.Errorf("failed to parse scenario: %w", err)
	}
	sc := f.Scenario
	p, err := f.loadPolicy(readFile)
	if err != nil {
		return nil, err
	}
	sc.Policy = p
	sc.Default()
	if err := errors.Join(sc.validateWorld()...); err != nil {
		return nil, fmt.Errorf("invalid scenario: %w", err)
	}
	return &sc, nil
}

func (f *scenarioFile) loadPolicy(readFile func(string) ([]byte, error)) (*spillwayv1alpha1.DependencyPolicy, error) {
	switch {
	case len(f.Policy) > 0 && f.PolicyFile != "":
		return nil, errors.New("policy, policyFile: give one, not both")
	case len(f.Policy) > 0:
		p, err := policy.Load(f.Policy)
		if err != nil {
			return nil, fmt.Errorf("policy: %w", err)
		}
		return p, nil
	case f.PolicyFile != "" && readFile == nil:
		return nil, errors.New("policyFile: this scenario cannot refer to files; give the policy inline")
	case f.PolicyFile != "":
		data, err := readFile(f.PolicyFile)
		if err != nil {
			return nil, fmt.Errorf("policyFile: %w", err)
		}
		p, err := policy.Load(data)
		if err != nil {
			return nil, fmt.Errorf("policyFile %s: %w", f.PolicyFile, err)
		}
		return p, nil
	}
	return nil, nil
}

// durationErrors walks doc, a decoded scenario document, along the fields of
// t and returns an error naming each duration field (metav1.Duration) whose
// value time.ParseDuration does not accept, with path as the prefix of the
// field names.
func durationErrors(doc any, t reflect.Type, path string) []error {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t == reflect.TypeFor[metav1.Duration]() {
		if s, ok := doc.(string); ok {
			if _, err := time.ParseDuration(s); err == nil {
				return nil
			}
			return []error{fmt.Errorf("%s: want a duration such as 90s, 5m or 1h30m, got %q", path, s)}
		}
		if doc == nil {
			return nil
		}
		return []error{fmt.Errorf("%s: want a duration such as 90s, 5m or 1h30m, got %v", path, doc)}
	}
	var errs []error
	switch t.Kind() {
	case reflect.Struct:
		m, ok := doc.(map[string]any)
		if !ok {
			return nil
		}
		for i := range t.NumField() {
			f := t.Field(i)
			name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
			switch {
			case name == "-" || !f.IsExported():
				continue
			case f.Anonymous && name == "":
				errs = append(errs, durationErrors(doc, f.Type, path)...)
				continue
			}
			if v, ok := m[name]; ok {
				errs = append(errs, durationErrors(v, f.Type, join(path, name))...)
			}
		}
	case reflect.Slice:
		items, ok := doc.([]any)
		if !ok {
			return nil
		}
		for i, v := range items {
			errs = append(errs, durationErrors(v, t.Elem(), fmt.Sprintf("%s[%d]", path, i))...)
		}
	}
	return errs
}

func join(path, name string) string {
	if path == "" {
		return name
	}
	return path + "." + name
}
