package monitoring

import (
	"encoding/json"
	"regexp"
	"strings"
	"testing"

	. "github.com/onsi/gomega"
)

// dashboard is the part of a Grafana dashboard the tests read.
type dashboard struct {
	UID           string  `json:"uid"`
	Title         string  `json:"title"`
	SchemaVersion int     `json:"schemaVersion"`
	Panels        []panel `json:"panels"`
	Templating    struct {
		List []variable `json:"list"`
	} `json:"templating"`
}

type panel struct {
	ID         int             `json:"id"`
	Type       string          `json:"type"`
	Title      string          `json:"title"`
	Datasource json.RawMessage `json:"datasource"`
	Targets    []struct {
		RefID      string          `json:"refId"`
		Expr       string          `json:"expr"`
		Datasource json.RawMessage `json:"datasource"`
	} `json:"targets"`
	Panels []panel `json:"panels"` // a collapsed row's
}

type variable struct {
	Name       string          `json:"name"`
	Type       string          `json:"type"`
	Query      json.RawMessage `json:"query"`
	Definition string          `json:"definition"`
	Datasource json.RawMessage `json:"datasource"`
}

func loadDashboard(t *testing.T) dashboard {
	t.Helper()
	var d dashboard
	if err := json.Unmarshal(readRepoFile(t, dashboardPath), &d); err != nil {
		t.Fatalf("parse %s: %v", dashboardPath, err)
	}
	return d
}

// allPanels lists the panels, those inside collapsed rows too.
func (d dashboard) allPanels() []panel {
	var out []panel
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			out = append(out, p)
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	return out
}

// datasourceRef is the datasource every panel, target and query variable
// must use: the dashboard's datasource variable, never a fixed UID.
const datasourceRef = `{"type":"prometheus","uid":"${datasource}"}`

func TestDashboardStructure(t *testing.T) {
	g := NewWithT(t)
	d := loadDashboard(t)
	g.Expect(d.SchemaVersion).To(BeNumerically(">=", 36), "a schemaVersion Grafana 9 and later read without migrating")
	g.Expect(d.Title).NotTo(BeEmpty())

	vars := map[string]variable{}
	for _, v := range d.Templating.List {
		vars[v.Name] = v
	}
	g.Expect(vars).To(HaveKey("datasource"))
	g.Expect(vars["datasource"].Type).To(Equal("datasource"))
	g.Expect(string(vars["datasource"].Query)).To(Equal(`"prometheus"`))
	for _, name := range []string{"namespace", "policy"} {
		g.Expect(vars).To(HaveKey(name))
		g.Expect(vars[name].Type).To(Equal("query"))
		g.Expect(compact(t, vars[name].Datasource)).To(Equal(datasourceRef), "variable %s", name)
	}

	ids := map[int]string{}
	panels := d.allPanels()
	g.Expect(panels).NotTo(BeEmpty())
	for _, p := range panels {
		g.Expect(p.ID).To(BeNumerically(">", 0), "panel %q has no id", p.Title)
		g.Expect(ids).NotTo(HaveKey(p.ID), "panel id %d is used by %q and %q", p.ID, ids[p.ID], p.Title)
		ids[p.ID] = p.Title
		if p.Type == "row" {
			continue
		}
		g.Expect(p.Title).NotTo(BeEmpty(), "panel %d", p.ID)
		g.Expect(compact(t, p.Datasource)).To(Equal(datasourceRef), "panel %q", p.Title)
		g.Expect(p.Targets).NotTo(BeEmpty(), "panel %q has no query", p.Title)
		for _, tg := range p.Targets {
			g.Expect(compact(t, tg.Datasource)).To(Equal(datasourceRef), "panel %q, query %s", p.Title, tg.RefID)
			g.Expect(tg.Expr).NotTo(BeEmpty(), "panel %q, query %s", p.Title, tg.RefID)
		}
	}
}

// TestDashboardHasNoFixedUIDs: apart from the dashboard's own uid, no "uid"
// in the JSON is anything but the datasource variable.
func TestDashboardHasNoFixedUIDs(t *testing.T) {
	raw := string(readRepoFile(t, dashboardPath))
	uid := regexp.MustCompile(`"uid":\s*"([^"]*)"`)
	d := loadDashboard(t)
	for _, m := range uid.FindAllStringSubmatch(raw, -1) {
		if m[1] != "${datasource}" && m[1] != d.UID {
			t.Errorf("fixed uid %q in %s: use ${datasource}", m[1], dashboardPath)
		}
	}
	if strings.Count(raw, `"uid": "`+d.UID+`"`) != 1 {
		t.Errorf("the dashboard's uid %q must appear once", d.UID)
	}
}

// TestDashboardCoversThePolicy: every panel's queries select the dashboard's
// policy (or, for the manager-wide ones, say so by their title).
func TestDashboardCoversThePolicy(t *testing.T) {
	for _, p := range loadDashboard(t).allPanels() {
		for _, tg := range p.Targets {
			perPolicy := strings.Contains(tg.Expr, `$policy`)
			global := strings.Contains(tg.Expr, "spillway_evaluation_lag_seconds") || strings.Contains(tg.Expr, "reconcile_errors_total")
			if !perPolicy && !global {
				t.Errorf("panel %q, query %s: %s does not select $policy", p.Title, tg.RefID, tg.Expr)
			}
		}
	}
}

func compact(t *testing.T, raw json.RawMessage) string {
	t.Helper()
	var v any
	if err := json.Unmarshal(raw, &v); err != nil {
		return string(raw)
	}
	b, _ := json.Marshal(v)
	return string(b)
}
