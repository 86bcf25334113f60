// Package monitoring tests what Spillway ships for monitoring: the Grafana
// dashboard (config/grafana/spillway.json), the alerting rules
// (config/prometheus/spillway-rules.yaml, wrapped in a PrometheusRule in
// config/prometheus/prometheusrule.yaml) and the Helm chart's copies of them.
//
// The rules are checked and unit-tested by promtool, from Debian's
// prometheus package (hack/setup-prometheus.sh); the dashboard's structure is
// read as JSON. The live test (live_test.go) runs the controller, workers on
// the worker library and a real Prometheus scraping both through an outage,
// and runs every panel's query and every alert's expression against it. It
// scrapes the manager as the Prometheus Operator scrapes the Helm chart's
// ServiceMonitor (operator_test.go), so it and TestOperatorScrapeLabels
// need helm (hack/setup-helm.sh): without it they skip, unless
// SPILLWAY_REQUIRE_HELM is set (make test sets it).
package monitoring
