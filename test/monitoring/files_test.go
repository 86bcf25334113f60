package monitoring

import (
	"os"
	"path/filepath"
	"testing"

	. "github.com/onsi/gomega"
	"sigs.k8s.io/yaml"

	"github.com/spillway-dev/spillway/internal/testenv"
)

// Paths of the shipped files, from the repository's root.
const (
	dashboardPath      = "config/grafana/spillway.json"
	rulesPath          = "config/prometheus/spillway-rules.yaml"
	rulesTestPath      = "config/prometheus/spillway-rules_test.yaml"
	prometheusRulePath = "config/prometheus/prometheusrule.yaml"
	chartDashboardPath = "charts/spillway/files/grafana/spillway.json"
	chartRulesPath     = "charts/spillway/files/prometheus/spillway-rules.yaml"
)

// repoFile is the path of a file of the repository.
func repoFile(rel string) string { return filepath.Join(testenv.RepoRoot(), rel) }

func readRepoFile(t *testing.T, rel string) []byte {
	t.Helper()
	b, err := os.ReadFile(repoFile(rel))
	if err != nil {
		t.Fatalf("read %s: %v", rel, err)
	}
	return b
}

// TestChartCopiesAreTheCanonicalFiles: the Helm chart ships the dashboard
// and the rules from copies (.Files.Get reads only inside the chart); they
// must be the files in config/, byte for byte.
func TestChartCopiesAreTheCanonicalFiles(t *testing.T) {
	for canonical, chartCopy := range map[string]string{dashboardPath: chartDashboardPath, rulesPath: chartRulesPath} {
		t.Run(chartCopy, func(t *testing.T) {
			if string(readRepoFile(t, chartCopy)) != string(readRepoFile(t, canonical)) {
				t.Errorf("%s differs from %s: run cp %s %s", chartCopy, canonical, canonical, chartCopy)
			}
		})
	}
}

// TestPrometheusRuleWrapsTheRulesFile: the PrometheusRule's spec is the plain
// rules file.
func TestPrometheusRuleWrapsTheRulesFile(t *testing.T) {
	g := NewWithT(t)
	var rules map[string]any
	g.Expect(yaml.Unmarshal(readRepoFile(t, rulesPath), &rules)).To(Succeed())
	var pr struct {
		APIVersion string         `json:"apiVersion"`
		Kind       string         `json:"kind"`
		Spec       map[string]any `json:"spec"`
	}
	g.Expect(yaml.Unmarshal(readRepoFile(t, prometheusRulePath), &pr)).To(Succeed())
	g.Expect(pr.APIVersion).To(Equal("monitoring.coreos.com/v1"))
	g.Expect(pr.Kind).To(Equal("PrometheusRule"))
	g.Expect(pr.Spec).To(Equal(rules), "the spec of %s must be %s", prometheusRulePath, rulesPath)
}
