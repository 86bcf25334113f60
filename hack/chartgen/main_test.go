package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	. "github.com/onsi/gomega"
)

// TestChartTemplatesAreCurrent regenerates the chart's templates from the
// committed config/ into a scratch tree and compares them with the committed
// chart: it fails when config/ changed without 'make manifests', or when a
// generated template was edited by hand.
func TestChartTemplatesAreCurrent(t *testing.T) {
	g := NewWithT(t)
	repo := filepath.Join("..", "..")
	scratch := t.TempDir()
	sources, err := filepath.Glob(filepath.Join(repo, "config", "crd", "bases", "*.yaml"))
	g.Expect(err).NotTo(HaveOccurred())
	sources = append(sources, filepath.Join(repo, "config", "rbac", "role.yaml"), filepath.Join(repo, "config", "webhook", "manifests.yaml"))
	for _, src := range sources {
		rel, err := filepath.Rel(repo, src)
		g.Expect(err).NotTo(HaveOccurred())
		copyFile(t, src, filepath.Join(scratch, rel))
	}
	g.Expect(generate(scratch)).To(Succeed())

	generated := 0
	err = filepath.WalkDir(filepath.Join(scratch, "charts"), func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, err := filepath.Rel(scratch, path)
		if err != nil {
			return err
		}
		want, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		got, err := os.ReadFile(filepath.Join(repo, rel))
		g.Expect(err).NotTo(HaveOccurred(), "%s is not committed: run 'make manifests'", rel)
		g.Expect(string(got)).To(Equal(string(want)), "%s is stale or edited by hand: run 'make manifests'", rel)
		generated++
		return nil
	})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(generated).To(Equal(len(sources)))
}

func TestTemplates(t *testing.T) {
	crd := "---\napiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\nmetadata:\n  annotations:\n    controller-gen.kubebuilder.io/version: v0.23.0\n  name: x.spillway.dev\nspec:\n  description: a {{ brace\n"
	role := "---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata:\n  name: manager-role\nrules: []\n"
	tests := []struct {
		name    string
		fn      func([]byte) ([]byte, error)
		in      string
		want    []string
		wantErr string
	}{{
		name: "CRD behind crds.install, kept with crds.keep, braces escaped",
		fn:   crdTemplate,
		in:   crd,
		want: []string{"{{- if .Values.crds.install }}\napiVersion:", "helm.sh/resource-policy: keep", `description: a {{ "{{" }} brace`, "{{- end }}\n"},
	}, {
		name:    "CRD in an unknown layout",
		fn:      crdTemplate,
		in:      strings.Replace(crd, "  annotations:\n", "", 1),
		wantErr: "the layout controller-gen writes",
	}, {
		name:    "two documents",
		fn:      crdTemplate,
		in:      crd + "---\n" + crd,
		wantErr: "want one YAML document",
	}, {
		name: "role named after the release",
		fn:   roleTemplate,
		in:   role,
		want: []string{`name: {{ include "spillway.fullname" . }}-manager-role`, `{{- include "spillway.labels" . | nindent 4 }}`},
	}, {
		name:    "role with another name",
		fn:      roleTemplate,
		in:      strings.Replace(role, "manager-role", "other", 1),
		wantErr: "the layout controller-gen writes",
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			out, err := tt.fn([]byte(tt.in))
			if tt.wantErr != "" {
				g.Expect(err).To(MatchError(ContainSubstring(tt.wantErr)))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(string(out)).NotTo(HavePrefix("---"))
			for _, w := range tt.want {
				g.Expect(string(out)).To(ContainSubstring(w))
			}
		})
	}
}

func copyFile(t *testing.T, src, dst string) {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dst, b, 0o644); err != nil {
		t.Fatal(err)
	}
}
