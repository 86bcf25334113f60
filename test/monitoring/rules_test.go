package monitoring

import (
	"os/exec"
	"strings"
	"testing"

	. "github.com/onsi/gomega"
	"sigs.k8s.io/yaml"

	"github.com/spillway-dev/spillway/internal/proctest"
)

// promtool finds Debian's promtool (package prometheus), or $PROMTOOL.
func promtool(t *testing.T) string {
	t.Helper()
	bin, err := proctest.LookPath("promtool", "PROMTOOL", "run hack/setup-prometheus.sh to install promtool (Debian's prometheus package)")
	if err != nil {
		t.Fatal(err)
	}
	return bin
}

func runPromtool(t *testing.T, args ...string) string {
	t.Helper()
	cmd := exec.Command(promtool(t), args...)
	cmd.Dir = repoFile("config/prometheus")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

func TestRulesPassPromtoolCheck(t *testing.T) {
	runPromtool(t, "check", "rules", "spillway-rules.yaml")
}

// TestRulesPassTheirUnitTests runs config/prometheus/spillway-rules_test.yaml:
// series that fire each alert and series that leave it silent.
func TestRulesPassTheirUnitTests(t *testing.T) {
	runPromtool(t, "test", "rules", "spillway-rules_test.yaml")
}

// rule is one alerting rule of the rules file.
type rule struct {
	Alert       string            `json:"alert"`
	Expr        string            `json:"expr"`
	For         string            `json:"for"`
	Labels      map[string]string `json:"labels"`
	Annotations map[string]string `json:"annotations"`
}

func loadRules(t *testing.T) []rule {
	t.Helper()
	var file struct {
		Groups []struct {
			Name  string `json:"name"`
			Rules []rule `json:"rules"`
		} `json:"groups"`
	}
	if err := yaml.Unmarshal(readRepoFile(t, rulesPath), &file); err != nil {
		t.Fatalf("parse %s: %v", rulesPath, err)
	}
	var rules []rule
	for _, g := range file.Groups {
		rules = append(rules, g.Rules...)
	}
	return rules
}

// TestEveryAlertIsTestedAndDocumented: each alert has a severity, a runbook
// section that exists in docs/runbook.md, and promtool tests that expect it
// both firing and silent.
func TestEveryAlertIsTestedAndDocumented(t *testing.T) {
	runbook := string(readRepoFile(t, "docs/runbook.md"))
	var tests struct {
		Tests []struct {
			AlertRuleTest []struct {
				Alertname string `json:"alertname"`
				ExpAlerts []any  `json:"exp_alerts"`
			} `json:"alert_rule_test"`
		} `json:"tests"`
	}
	if err := yaml.Unmarshal(readRepoFile(t, rulesTestPath), &tests); err != nil {
		t.Fatalf("parse %s: %v", rulesTestPath, err)
	}
	firing, silent := map[string]bool{}, map[string]bool{}
	for _, tc := range tests.Tests {
		for _, a := range tc.AlertRuleTest {
			if len(a.ExpAlerts) > 0 {
				firing[a.Alertname] = true
			} else {
				silent[a.Alertname] = true
			}
		}
	}
	const runbookURL = "https://github.com/spillway-dev/spillway/blob/main/docs/runbook.md#"
	for _, r := range loadRules(t) {
		t.Run(r.Alert, func(t *testing.T) {
			g := NewWithT(t)
			g.Expect(r.Labels).To(HaveKeyWithValue("severity", BeElementOf("warning", "critical")))
			g.Expect(r.Annotations).To(HaveKey("summary"))
			g.Expect(r.Annotations).To(HaveKey("description"))
			g.Expect(r.Annotations["runbook_url"]).To(HavePrefix(runbookURL))
			anchor := strings.TrimPrefix(r.Annotations["runbook_url"], runbookURL)
			g.Expect(anchor).To(Equal(strings.ToLower(r.Alert)))
			g.Expect(runbook).To(ContainSubstring("### "+r.Alert+"\n"), "docs/runbook.md needs a section titled %s (anchor #%s)", r.Alert, anchor)
			g.Expect(firing[r.Alert]).To(BeTrue(), "%s has no promtool test where it fires", r.Alert)
			g.Expect(silent[r.Alert]).To(BeTrue(), "%s has no promtool test where it stays silent", r.Alert)
		})
	}
}
