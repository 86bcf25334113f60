package promtest

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/prometheus/client_golang/api"
	promv1 "github.com/prometheus/client_golang/api/prometheus/v1"
	"github.com/prometheus/common/model"
)

// TestScrapesTheDependency starts a real prometheus scraping a Dependency
// and reads the dependency's error ratio back with the official client, as
// the controller does.
func TestScrapesTheDependency(t *testing.T) {
	dep := NewDependency(t)
	dep.Load(200, 0.25)
	srv := Start(t, dep.Target())

	c, err := api.NewClient(api.Config{Address: srv.URL()})
	if err != nil {
		t.Fatal(err)
	}
	q := promv1.NewAPI(c)
	query := ErrorRatioQuery(5 * time.Second)
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
		v, _, _, err := q.Query(ctx, query, time.Time{})
		cancel()
		if err != nil {
			t.Fatalf("query %q: %v", query, err)
		}
		if vec, ok := v.(model.Vector); ok && len(vec) == 1 {
			ratio := float64(vec[0].Value)
			// 25% of the requests fail; rate() over a few scrapes of counters
			// moved every 100ms is close to it, not exact.
			if math.Abs(ratio-0.25) < 0.1 {
				break
			}
			t.Logf("ratio %v so far", ratio)
		}
		if time.Now().After(deadline) {
			t.Fatalf("no error ratio near 0.25 from %q within 30s: last %v", query, v)
		}
		time.Sleep(500 * time.Millisecond)
	}

	srv.Stop()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
	defer cancel()
	if _, _, _, err := q.Query(ctx, query, time.Time{}); err == nil {
		t.Fatal("a query to a stopped prometheus succeeded")
	}
}

func TestConfig(t *testing.T) {
	got := config([]string{"127.0.0.1:1", "127.0.0.1:2"})
	want := "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n" +
		"scrape_configs:\n- job_name: dependency\n  static_configs:\n  - targets: [\"127.0.0.1:1\", \"127.0.0.1:2\"]\n"
	if got != want {
		t.Errorf("config =\n%s\nwant\n%s", got, want)
	}
}
