package v1alpha1_test

import (
	"fmt"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
)

// TestPrometheusSignalValidation runs spec.signals.prometheus through the
// API server: what it refuses, with a message naming the field, and what it
// defaults.
func TestPrometheusSignalValidation(t *testing.T) {
	ns := newNamespace(t)
	const query = `errorRatioQuery: "sum(rate(errors_total[30s])) / sum(rate(requests_total[30s]))"`
	cases := []struct {
		name string
		spec string
		want []string
	}{{
		name: "address not a URL",
		spec: "address: prometheus:9090\n" + query,
		want: []string{"spec.signals.prometheus.address", "address must be an http or https URL"},
	}, {
		name: "address ftp",
		spec: "address: ftp://prometheus:9090\n" + query,
		want: []string{"spec.signals.prometheus.address", "address must be an http or https URL"},
	}, {
		name: "address without host",
		spec: "address: 'http://'\n" + query,
		want: []string{"spec.signals.prometheus.address", "address must be an http or https URL"},
	}, {
		name: "address missing",
		spec: query,
		want: []string{"spec.signals.prometheus.address", "Required value"},
	}, {
		name: "errorRatioQuery missing",
		spec: "address: http://prometheus:9090",
		want: []string{"spec.signals.prometheus.errorRatioQuery", "Required value"},
	}, {
		name: "errorRatioQuery blank",
		spec: "address: http://prometheus:9090\nerrorRatioQuery: '   '",
		want: []string{"spec.signals.prometheus.errorRatioQuery", "errorRatioQuery must not be empty"},
	}, {
		name: "rateQuery blank",
		spec: "address: http://prometheus:9090\n" + query + "\nrateQuery: ' '",
		want: []string{"spec.signals.prometheus.rateQuery", "rateQuery must not be empty when set"},
	}, {
		name: "interval 0s",
		spec: "address: http://prometheus:9090\n" + query + "\ninterval: 0s",
		want: []string{"spec.signals.prometheus.interval", "interval must be a duration between 1s and 10m"},
	}, {
		name: "timeout above interval",
		spec: "address: http://prometheus:9090\n" + query + "\ninterval: 2s\ntimeout: 3s",
		want: []string{"spec.signals.prometheus", "prometheus.timeout must be at most prometheus.interval"},
	}, {
		name: "timeout above defaulted interval",
		spec: "address: http://prometheus:9090\n" + query + "\ntimeout: 20s",
		want: []string{"spec.signals.prometheus", "prometheus.timeout must be at most prometheus.interval"},
	}, {
		name: "credentials without a name",
		spec: "address: http://prometheus:9090\n" + query + "\ncredentialsSecretRef: {}",
		want: []string{"spec.signals.prometheus.credentialsSecretRef.name", "Required value"},
	}}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			spec := "capacity: {concurrency: 40}\nsignals:\n  prometheus:\n" + indent(tc.spec, "    ")
			err := env.Client.Create(t.Context(), policyFromSpec(t, ns, fmt.Sprintf("signal-%d", i), spec))
			g.Expect(err).To(HaveOccurred(), "the API server accepted an invalid signal")
			g.Expect(apierrors.IsInvalid(err)).To(BeTrue(), "want an Invalid error, got %v", err)
			for _, want := range tc.want {
				g.Expect(err.Error()).To(ContainSubstring(want))
			}
			g.Expect(err.Error()).NotTo(ContainSubstring("compilation failed"))
			g.Expect(err.Error()).NotTo(ContainSubstring("evaluation error"))
		})
	}

	t.Run("limitedBy unknown", func(t *testing.T) {
		g := NewWithT(t)
		err := env.Client.Create(t.Context(), policyFromSpec(t, ns, "limited-by",
			"capacity: {concurrency: 40}\nconsumers:\n- {scaledObjectName: workers, limitedBy: Sidecar}"))
		g.Expect(apierrors.IsInvalid(err)).To(BeTrue(), "want an Invalid error, got %v", err)
		g.Expect(err.Error()).To(ContainSubstring("spec.consumers[0].limitedBy"))
	})

	t.Run("defaults", func(t *testing.T) {
		g := NewWithT(t)
		pol := policyFromSpec(t, ns, "signal-defaults", "capacity: {concurrency: 40}\nsignals:\n  prometheus:\n"+
			indent("address: https://prometheus.monitoring:9090/prefix\n"+query+"\ncredentialsSecretRef: {name: prom-creds}", "    ")+
			"consumers:\n- {scaledObjectName: workers, limitedBy: Replicas}")
		g.Expect(env.Client.Create(t.Context(), pol)).To(Succeed())
		var got spillwayv1alpha1.DependencyPolicy
		g.Expect(env.Client.Get(t.Context(), client.ObjectKeyFromObject(pol), &got)).To(Succeed())
		p := got.Spec.Signals.Prometheus
		g.Expect(p.Interval.Duration).To(Equal(15 * time.Second))
		g.Expect(p.Timeout.Duration).To(Equal(5 * time.Second))
		g.Expect(p.RateQuery).To(BeEmpty())
		g.Expect(p.CredentialsSecretRef.Name).To(Equal("prom-creds"))
		g.Expect(got.Spec.Consumers[0].LimitedBy).To(Equal(spillwayv1alpha1.LimitedByReplicas))
	})
}
