package monitoring

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"github.com/spillway-dev/spillway/internal/promtest"
	"github.com/spillway-dev/spillway/internal/testenv"
)

// The live test scrapes the manager as the Prometheus Operator would scrape
// the chart's release: it renders the chart with helm, reads the
// ServiceMonitor, the metrics Service and the Deployment, and writes the
// scrape config prometheus-operator generates for the ServiceMonitor's
// endpoint (pkg/prometheus/promcfg.go, generateServiceMonitorConfig, at
// v0.85.0, the version whose CRDs test/helm installs). The operator's
// Kubernetes service discovery (role endpoints) is replaced by a static
// target on loopback that carries the meta labels the discovery would give
// the manager's pod; the relabelling that turns them into the job,
// namespace, service, pod, container and endpoint labels, and honor_labels,
// are the operator's. A change to the chart's ServiceMonitor is therefore
// seen by the test, and a field the generator below does not know fails it.

const (
	// release and releaseNamespace are the chart's release in the test: the
	// manager runs in releaseNamespace, where its leader-election Lease is.
	release          = "spillway"
	releaseNamespace = "spillway-system"
	// managerPod is the name the manager's pod has in the service discovery.
	managerPod = "spillway-7d9c5b8f6-q2x7k"
	// helmVersion is the helm hack/setup-helm.sh builds (HELM_VERSION).
	helmVersion = "4.3.2"
)

// findHelm is $SPILLWAY_HELM, else the helm hack/setup-helm.sh caches in
// $SPILLWAY_CACHE (default ~/.cache/spillway), as test/helm finds it.
func findHelm() (string, error) {
	if bin := os.Getenv("SPILLWAY_HELM"); bin != "" {
		return bin, nil
	}
	cache := os.Getenv("SPILLWAY_CACHE")
	if cache == "" {
		base, err := os.UserCacheDir()
		if err != nil {
			return "", err
		}
		cache = filepath.Join(base, "spillway")
	}
	version := os.Getenv("HELM_VERSION")
	if version == "" {
		version = helmVersion
	}
	bin := filepath.Join(cache, "helm", version, "helm")
	if _, err := os.Stat(bin); err != nil {
		return "", fmt.Errorf("helm not found at %s: run make helm (hack/setup-helm.sh)", bin)
	}
	return bin, nil
}

// renderChart runs helm template on charts/spillway for the release, with
// the values set, and returns the objects by kind and name.
func renderChart(t *testing.T, set ...string) map[string]map[string][]byte {
	t.Helper()
	bin, err := findHelm()
	if err != nil {
		if os.Getenv("SPILLWAY_REQUIRE_HELM") == "" {
			t.Skipf("%v (set SPILLWAY_REQUIRE_HELM to fail instead)", err)
		}
		t.Fatal(err)
	}
	args := []string{"template", release, filepath.Join(testenv.RepoRoot(), "charts", "spillway"), "--namespace", releaseNamespace}
	for _, s := range set {
		args = append(args, "--set", s)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	home := t.TempDir()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+home, "HELM_CONFIG_HOME="+home, "HELM_DATA_HOME="+home)
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("helm %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
	}
	objs := map[string]map[string][]byte{}
	r := utilyaml.NewYAMLReader(bufio.NewReader(&out))
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("split helm's output: %v", err)
		}
		var obj struct {
			Kind     string `json:"kind"`
			Metadata struct {
				Name string `json:"name"`
			} `json:"metadata"`
		}
		if err := yaml.Unmarshal(doc, &obj); err != nil {
			t.Fatalf("parse helm's output: %v\n%s", err, doc)
		}
		if obj.Kind == "" {
			continue // only comments
		}
		if objs[obj.Kind] == nil {
			objs[obj.Kind] = map[string][]byte{}
		}
		objs[obj.Kind][obj.Metadata.Name] = doc
	}
	return objs
}

// serviceMonitor is the part of a ServiceMonitor the generator reads. Its
// endpoints are read strictly: a field the generator does not handle
// (relabelings, TLS, authorisation...) fails the test instead of being
// scraped differently than the operator would.
type serviceMonitor struct {
	Metadata struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
	} `json:"metadata"`
	Spec struct {
		JobLabel          string            `json:"jobLabel"`
		TargetLabels      []string          `json:"targetLabels"`
		PodTargetLabels   []string          `json:"podTargetLabels"`
		Endpoints         []map[string]any  `json:"endpoints"`
		Selector          labelSelector     `json:"selector"`
		NamespaceSelector namespaceSelector `json:"namespaceSelector"`
	} `json:"spec"`
}

type labelSelector struct {
	MatchLabels      map[string]string `json:"matchLabels"`
	MatchExpressions []struct {
		Key      string   `json:"key"`
		Operator string   `json:"operator"`
		Values   []string `json:"values"`
	} `json:"matchExpressions"`
}

type namespaceSelector struct {
	Any        bool     `json:"any"`
	MatchNames []string `json:"matchNames"`
}

// endpoint is the ServiceMonitor endpoint's fields the generator handles.
type endpoint struct {
	Port          string `json:"port"`
	Path          string `json:"path"`
	Scheme        string `json:"scheme"`
	Interval      string `json:"interval"`
	ScrapeTimeout string `json:"scrapeTimeout"`
	HonorLabels   bool   `json:"honorLabels"`
	FilterRunning *bool  `json:"filterRunning"`
}

// chartService and chartDeployment are the parts of the metrics Service and the
// manager's Deployment the service discovery reads.
type chartService struct {
	Metadata struct {
		Name      string            `json:"name"`
		Namespace string            `json:"namespace"`
		Labels    map[string]string `json:"labels"`
	} `json:"metadata"`
	Spec struct {
		Selector map[string]string `json:"selector"`
		Ports    []struct {
			Name       string `json:"name"`
			TargetPort any    `json:"targetPort"`
		} `json:"ports"`
	} `json:"spec"`
}

type chartDeployment struct {
	Spec struct {
		Template struct {
			Metadata struct {
				Labels map[string]string `json:"labels"`
			} `json:"metadata"`
			Spec struct {
				Containers []struct {
					Name  string `json:"name"`
					Ports []struct {
						Name          string `json:"name"`
						ContainerPort int    `json:"containerPort"`
					} `json:"ports"`
				} `json:"containers"`
			} `json:"spec"`
		} `json:"template"`
	} `json:"spec"`
}

// relabel is one of relabel_configs.
type relabel struct {
	Action       string   `json:"action,omitempty"`
	SourceLabels []string `json:"source_labels,omitempty"`
	Separator    string   `json:"separator,omitempty"`
	Regex        string   `json:"regex,omitempty"`
	Replacement  string   `json:"replacement,omitempty"`
	TargetLabel  string   `json:"target_label,omitempty"`
}

// scrapeConfig is one of scrape_configs.
type scrapeConfig struct {
	JobName        string         `json:"job_name"`
	HonorLabels    bool           `json:"honor_labels"`
	ScrapeInterval string         `json:"scrape_interval,omitempty"`
	ScrapeTimeout  string         `json:"scrape_timeout,omitempty"`
	MetricsPath    string         `json:"metrics_path,omitempty"`
	Scheme         string         `json:"scheme,omitempty"`
	StaticConfigs  []staticConfig `json:"static_configs"`
	RelabelConfigs []relabel      `json:"relabel_configs,omitempty"`
}

type staticConfig struct {
	Targets []string          `json:"targets"`
	Labels  map[string]string `json:"labels,omitempty"`
}

var invalidLabelChars = regexp.MustCompile(`[^a-zA-Z0-9_]`)

// sanitize makes a Kubernetes label name a Prometheus one, as the service
// discovery and the operator do (app.kubernetes.io/name:
// app_kubernetes_io_name).
func sanitize(name string) string { return invalidLabelChars.ReplaceAllString(name, "_") }

// operatorScrapeConfig is the scrape config of the ServiceMonitor's only
// endpoint, with the manager's metrics served at addr (host:port on
// loopback). objs is renderChart's answer.
func operatorScrapeConfig(t *testing.T, objs map[string]map[string][]byte, addr string) scrapeConfig {
	t.Helper()
	var sm serviceMonitor
	var svc chartService
	var dep chartDeployment
	decode := func(kind, name string, into any) {
		t.Helper()
		doc, ok := objs[kind][name]
		if !ok {
			t.Fatalf("the chart rendered no %s %s", kind, name)
		}
		if err := yaml.Unmarshal(doc, into); err != nil {
			t.Fatalf("parse the %s %s: %v", kind, name, err)
		}
	}
	decode("ServiceMonitor", release, &sm)
	decode("Service", release+"-metrics", &svc)
	decode("Deployment", release, &dep)
	if len(sm.Spec.Endpoints) != 1 {
		t.Fatalf("the ServiceMonitor has %d endpoints; the live test scrapes one", len(sm.Spec.Endpoints))
	}
	raw, err := yaml.Marshal(sm.Spec.Endpoints[0])
	if err != nil {
		t.Fatal(err)
	}
	var ep endpoint
	if err := yaml.UnmarshalStrict(raw, &ep); err != nil {
		t.Fatalf("the ServiceMonitor's endpoint has a field the live test's generator does not handle (extend operatorScrapeConfig as prometheus-operator does): %v\n%s", err, raw)
	}
	if ep.Scheme != "" && ep.Scheme != "http" {
		t.Fatalf("the live test scrapes plain HTTP (metrics.secure=false), the ServiceMonitor says %s", ep.Scheme)
	}

	// What the service discovery sees: the Service must be in a namespace
	// the ServiceMonitor selects, and select the pod; the endpoint's port
	// is the Service port's, its container the one whose port it targets.
	ns := svc.Metadata.Namespace
	if !sm.Spec.NamespaceSelector.Any && !slices.Contains(sm.Spec.NamespaceSelector.MatchNames, ns) &&
		(len(sm.Spec.NamespaceSelector.MatchNames) > 0 || sm.Metadata.Namespace != ns) {
		t.Fatalf("the ServiceMonitor in %s does not select the namespace %s of the Service", sm.Metadata.Namespace, ns)
	}
	podLabels := dep.Spec.Template.Metadata.Labels
	for k, v := range svc.Spec.Selector {
		if podLabels[k] != v {
			t.Fatalf("the Service %s selects %s=%s, which the manager's pods do not have (%v)", svc.Metadata.Name, k, v, podLabels)
		}
	}
	meta := map[string]string{
		"__meta_kubernetes_namespace":                    ns,
		"__meta_kubernetes_endpoints_name":               svc.Metadata.Name,
		"__meta_kubernetes_service_name":                 svc.Metadata.Name,
		"__meta_kubernetes_endpoint_ready":               "true",
		"__meta_kubernetes_endpoint_port_protocol":       "TCP",
		"__meta_kubernetes_endpoint_address_target_kind": "Pod",
		"__meta_kubernetes_endpoint_address_target_name": managerPod,
		"__meta_kubernetes_pod_name":                     managerPod,
		"__meta_kubernetes_pod_phase":                    "Running",
		"__meta_kubernetes_pod_ready":                    "true",
		"__meta_kubernetes_pod_controller_kind":          "ReplicaSet",
		"__meta_kubernetes_pod_container_init":           "false",
	}
	for k, v := range svc.Metadata.Labels {
		meta["__meta_kubernetes_service_label_"+sanitize(k)] = v
		meta["__meta_kubernetes_service_labelpresent_"+sanitize(k)] = "true"
	}
	for k, v := range podLabels {
		meta["__meta_kubernetes_pod_label_"+sanitize(k)] = v
		meta["__meta_kubernetes_pod_labelpresent_"+sanitize(k)] = "true"
	}
	found := false
	for _, p := range svc.Spec.Ports {
		if p.Name != ep.Port {
			continue
		}
		for _, c := range dep.Spec.Template.Spec.Containers {
			for _, cp := range c.Ports {
				if fmt.Sprint(p.TargetPort) == cp.Name || fmt.Sprint(p.TargetPort) == strconv.Itoa(cp.ContainerPort) {
					meta["__meta_kubernetes_endpoint_port_name"] = p.Name
					meta["__meta_kubernetes_pod_container_name"] = c.Name
					meta["__meta_kubernetes_pod_container_port_name"] = cp.Name
					meta["__meta_kubernetes_pod_container_port_number"] = strconv.Itoa(cp.ContainerPort)
					found = true
				}
			}
		}
	}
	if !found {
		t.Fatalf("no port of the Service %s is named %q and targets a port of the manager's container: the ServiceMonitor's endpoint finds no target", svc.Metadata.Name, ep.Port)
	}

	// The relabelling, in generateServiceMonitorConfig's order.
	rules := []relabel{{SourceLabels: []string{"job"}, TargetLabel: "__tmp_prometheus_job_name"}}
	for _, k := range slices.Sorted(maps.Keys(sm.Spec.Selector.MatchLabels)) {
		rules = append(rules, relabel{
			Action:       "keep",
			SourceLabels: []string{"__meta_kubernetes_service_label_" + sanitize(k), "__meta_kubernetes_service_labelpresent_" + sanitize(k)},
			Regex:        "(" + sm.Spec.Selector.MatchLabels[k] + ");true",
		})
	}
	for _, e := range sm.Spec.Selector.MatchExpressions {
		label := []string{"__meta_kubernetes_service_label_" + sanitize(e.Key), "__meta_kubernetes_service_labelpresent_" + sanitize(e.Key)}
		present := []string{"__meta_kubernetes_service_labelpresent_" + sanitize(e.Key)}
		switch e.Operator {
		case "In":
			rules = append(rules, relabel{Action: "keep", SourceLabels: label, Regex: "(" + strings.Join(e.Values, "|") + ");true"})
		case "NotIn":
			rules = append(rules, relabel{Action: "drop", SourceLabels: label, Regex: "(" + strings.Join(e.Values, "|") + ");true"})
		case "Exists":
			rules = append(rules, relabel{Action: "keep", SourceLabels: present, Regex: "true"})
		case "DoesNotExist":
			rules = append(rules, relabel{Action: "drop", SourceLabels: present, Regex: "true"})
		}
	}
	if ep.Port == "" {
		t.Fatal("the ServiceMonitor's endpoint names no port")
	}
	target := []string{"__meta_kubernetes_endpoint_address_target_kind", "__meta_kubernetes_endpoint_address_target_name"}
	rules = append(rules,
		relabel{Action: "keep", SourceLabels: []string{"__meta_kubernetes_endpoint_port_name"}, Regex: ep.Port},
		relabel{SourceLabels: target, Separator: ";", Regex: "Node;(.*)", Replacement: "${1}", TargetLabel: "node"},
		relabel{SourceLabels: target, Separator: ";", Regex: "Pod;(.*)", Replacement: "${1}", TargetLabel: "pod"},
		relabel{SourceLabels: []string{"__meta_kubernetes_namespace"}, TargetLabel: "namespace"},
		relabel{SourceLabels: []string{"__meta_kubernetes_service_name"}, TargetLabel: "service"},
		relabel{SourceLabels: []string{"__meta_kubernetes_pod_name"}, TargetLabel: "pod"},
		relabel{SourceLabels: []string{"__meta_kubernetes_pod_container_name"}, TargetLabel: "container"},
	)
	if ep.FilterRunning == nil || *ep.FilterRunning {
		rules = append(rules, relabel{Action: "drop", SourceLabels: []string{"__meta_kubernetes_pod_phase"}, Regex: "(Failed|Succeeded)"})
	}
	for _, l := range sm.Spec.TargetLabels {
		rules = append(rules, relabel{SourceLabels: []string{"__meta_kubernetes_service_label_" + sanitize(l)}, TargetLabel: sanitize(l), Regex: "(.+)", Replacement: "${1}"})
	}
	for _, l := range sm.Spec.PodTargetLabels {
		rules = append(rules, relabel{SourceLabels: []string{"__meta_kubernetes_pod_label_" + sanitize(l)}, TargetLabel: sanitize(l), Regex: "(.+)", Replacement: "${1}"})
	}
	rules = append(rules, relabel{SourceLabels: []string{"__meta_kubernetes_service_name"}, TargetLabel: "job", Replacement: "${1}"})
	if sm.Spec.JobLabel != "" {
		rules = append(rules, relabel{SourceLabels: []string{"__meta_kubernetes_service_label_" + sanitize(sm.Spec.JobLabel)}, TargetLabel: "job", Regex: "(.+)", Replacement: "${1}"})
	}
	rules = append(rules, relabel{TargetLabel: "endpoint", Replacement: ep.Port})

	return scrapeConfig{
		JobName:        fmt.Sprintf("serviceMonitor/%s/%s/0", sm.Metadata.Namespace, sm.Metadata.Name),
		HonorLabels:    ep.HonorLabels,
		ScrapeInterval: ep.Interval,
		ScrapeTimeout:  ep.ScrapeTimeout,
		MetricsPath:    ep.Path,
		Scheme:         ep.Scheme,
		StaticConfigs:  []staticConfig{{Targets: []string{addr}, Labels: meta}},
		RelabelConfigs: rules,
	}
}

// TestOperatorScrapeLabels scrapes a target exporting a policy series and a
// manager series with the scrape config operatorScrapeConfig renders from
// the chart: the target gets the labels the Prometheus Operator gives it
// (job, namespace, service, pod, container, endpoint, instance), and the
// policy series keeps its own namespace (the ServiceMonitor honours labels),
// where the manager's series has the manager's.
func TestOperatorScrapeLabels(t *testing.T) {
	chart := renderChart(t, "serviceMonitor.enabled=true", "metrics.secure=false",
		"serviceMonitor.interval=1s", "serviceMonitor.scrapeTimeout=1s")
	reg := prometheus.NewRegistry()
	policy := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "spillway_policy_limit", Help: "h"}, []string{"namespace", "name"})
	own := prometheus.NewGauge(prometheus.GaugeOpts{Name: "spillway_test_manager_up", Help: "h"})
	reg.MustRegister(policy, own)
	policy.WithLabelValues("shop", "pay").Set(4)
	policy.WithLabelValues("bank", "pay").Set(8)
	own.Set(1)
	target := serveMetrics(t, promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	cfg, err := yaml.Marshal([]scrapeConfig{operatorScrapeConfig(t, chart, target.addr)})
	if err != nil {
		t.Fatal(err)
	}
	prom := promtest.StartScraping(t, string(cfg))
	targetLabels := map[string]string{
		"job": release + "-metrics", "service": release + "-metrics", "pod": managerPod,
		"container": "manager", "endpoint": "http-metrics", "instance": target.addr,
	}
	for query, want := range map[string][]map[string]string{
		`spillway_policy_limit`: {
			{"__name__": "spillway_policy_limit", "namespace": "shop", "name": "pay"},
			{"__name__": "spillway_policy_limit", "namespace": "bank", "name": "pay"},
		},
		`spillway_test_manager_up`: {{"__name__": "spillway_test_manager_up", "namespace": releaseNamespace}},
	} {
		for _, w := range want {
			maps.Copy(w, targetLabels)
		}
		var got []series
		deadline := time.Now().Add(30 * time.Second)
		for len(got) < len(want) && time.Now().Before(deadline) {
			time.Sleep(500 * time.Millisecond)
			if got, err = queryRange(prom.URL(), query, time.Now().Add(-time.Second), time.Now()); err != nil {
				t.Fatal(err)
			}
		}
		var metrics []map[string]string
		for _, s := range got {
			metrics = append(metrics, s.Metric)
		}
		for _, w := range want {
			if !slices.ContainsFunc(metrics, func(m map[string]string) bool { return maps.Equal(m, w) }) {
				t.Errorf("%s: no series %v; Prometheus has %v\nscrape config:\n%s", query, w, metrics, cfg)
			}
		}
	}
}
