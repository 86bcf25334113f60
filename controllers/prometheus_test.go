package controllers

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/prometheus/client_golang/prometheus/testutil"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/promtest"
)

// bearerProxy is an authenticating proxy in front of a Prometheus, as many
// clusters run one: it forwards only requests bearing token.
func bearerProxy(t *testing.T, upstream, token string) string {
	t.Helper()
	u, err := url.Parse(upstream)
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(u)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer "+token {
			http.Error(w, "unauthorized", http.StatusUnauthorized)
			return
		}
		proxy.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// TestPrometheusHTTP runs PrometheusHTTP against a real prometheus: the
// shapes of answer it takes, the ones it refuses, and how it tells a refused
// query from an unreachable server.
func TestPrometheusHTTP(t *testing.T) {
	t.Parallel()
	srv := promtest.Start(t)
	target := PrometheusTarget{Address: srv.URL()}
	q := PrometheusHTTP{}
	query := func(target PrometheusTarget, query string) (float64, error) {
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		return q.QueryValue(ctx, target, query)
	}
	reason := func(err error) string {
		var se *SignalError
		if errors.As(err, &se) {
			return se.Reason
		}
		return ""
	}

	for _, tc := range []struct {
		query  string
		want   float64
		noData bool
		reason string
	}{
		{query: "vector(0.25)", want: 0.25},
		{query: "scalar(vector(0.5))", want: 0.5},
		{query: "vector(0) / vector(0)", noData: true},
		{query: `up{job="no-such-job"}`, noData: true},
		{query: `label_replace(vector(1), "a", "x", "", "") or label_replace(vector(2), "a", "y", "", "")`, reason: ReasonQueryFailed},
		{query: `sum(rate(`, reason: ReasonQueryFailed},
		{query: `vector(1) / vector(0)`, reason: ReasonQueryFailed},
		{query: `"a string"`, reason: ReasonQueryFailed},
	} {
		t.Run(tc.query, func(t *testing.T) {
			g := NewWithT(t)
			v, err := query(target, tc.query)
			switch {
			case tc.noData:
				g.Expect(err).To(MatchError(ErrNoData))
			case tc.reason != "":
				g.Expect(reason(err)).To(Equal(tc.reason), "error %v", err)
			default:
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(v).To(Equal(tc.want))
			}
		})
	}

	t.Run("credentials", func(t *testing.T) {
		g := NewWithT(t)
		proxied := bearerProxy(t, srv.URL(), "s3cret")
		v, err := query(PrometheusTarget{Address: proxied, BearerToken: "s3cret"}, "vector(0.75)")
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(v).To(Equal(0.75))
		_, err = query(PrometheusTarget{Address: proxied}, "vector(0.75)")
		g.Expect(reason(err)).To(Equal(ReasonQueryFailed), "no token: %v", err)
		_, err = query(PrometheusTarget{Address: proxied, Username: "u", Password: "p"}, "vector(0.75)")
		g.Expect(reason(err)).To(Equal(ReasonQueryFailed), "basic instead of bearer: %v", err)
	})

	t.Run("stopped", func(t *testing.T) {
		g := NewWithT(t)
		stopped := promtest.Start(t)
		stopped.Stop()
		_, err := query(PrometheusTarget{Address: stopped.URL()}, "vector(1)")
		g.Expect(reason(err)).To(Equal(ReasonPrometheusUnreachable), "error %v", err)
	})
}

// hungServer accepts connections and never answers, like a Prometheus
// stuck in a long query or a black-holed route.
func hungServer(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c)
		}
	}()
	t.Cleanup(func() { l.Close(); close(done) })
	return "http://" + l.Addr().String()
}

// TestSignalsNeverBlock: Observe returns at once even when Prometheus hangs;
// the query fails after its timeout, and only then the signal says so. It
// reads credentials from a real Secret, and a missing one is a condition too.
func TestSignalsNeverBlock(t *testing.T) {
	t.Parallel()
	g := NewWithT(t)
	ns := newNamespace(t)
	const timeout = 2 * time.Second
	pol := &spillwayv1alpha1.DependencyPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "hung"},
		Spec: spillwayv1alpha1.DependencyPolicySpec{Signals: &spillwayv1alpha1.Signals{Prometheus: &spillwayv1alpha1.PrometheusSignal{
			Address:         hungServer(t),
			ErrorRatioQuery: "vector(1)",
			Interval:        metav1.Duration{Duration: 10 * time.Second},
			Timeout:         metav1.Duration{Duration: timeout},
		}}},
	}
	s := NewSignals(PrometheusHTTP{}, env.Client)

	start := time.Now()
	sig, st, prev := s.Observe(pol, 30*time.Second)
	g.Expect(time.Since(start)).To(BeNumerically("<", timeout), "Observe waited for the query")
	g.Expect(sig.Valid).To(BeFalse())
	g.Expect(st.Reason).To(Equal(ReasonSignalPending))
	g.Expect(prev).To(BeEmpty())
	g.Eventually(func() string {
		_, st, _ := s.Observe(pol, 30*time.Second)
		return st.Reason
	}).WithTimeout(10 * time.Second).WithPolling(100 * time.Millisecond).Should(Equal(ReasonPrometheusUnreachable))
	_, st, _ = s.Observe(pol, 30*time.Second)
	g.Expect(st.Message).To(ContainSubstring("deadline exceeded"))
	g.Expect(testutil.ToFloat64(signalQueryFailures.WithLabelValues(ReasonPrometheusUnreachable))).To(BeNumerically(">=", 1))

	// Credentials: a Secret that is missing, then one with a token, through
	// an authenticating proxy in front of a real prometheus.
	prom := promtest.Start(t)
	pol = pol.DeepCopy()
	pol.Name = "credentials"
	pol.Spec.Signals.Prometheus.Address = bearerProxy(t, prom.URL(), "s3cret")
	pol.Spec.Signals.Prometheus.Interval = metav1.Duration{Duration: time.Second}
	pol.Spec.Signals.Prometheus.Timeout = metav1.Duration{Duration: time.Second}
	pol.Spec.Signals.Prometheus.ErrorRatioQuery = "vector(0.125)"
	pol.Spec.Signals.Prometheus.CredentialsSecretRef = &spillwayv1alpha1.SecretReference{Name: "prometheus-credentials"}
	observe := func() signalStatus {
		_, st, _ := s.Observe(pol, 30*time.Second)
		return st
	}
	g.Eventually(observe).WithTimeout(10 * time.Second).WithPolling(100 * time.Millisecond).Should(HaveField("Reason", ReasonCredentialsUnavailable))
	g.Expect(env.Client.Create(t.Context(), &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "prometheus-credentials"},
		Data:       map[string][]byte{"token": []byte("s3cret")},
	})).To(Succeed())
	g.Eventually(observe).WithTimeout(10 * time.Second).WithPolling(100 * time.Millisecond).Should(HaveField("Reason", ReasonSignalHealthy))
	sig, _, _ = s.Observe(pol, 30*time.Second)
	g.Expect(sig.Valid).To(BeTrue())
	g.Expect(sig.Ratio).To(Equal(0.125))
	g.Expect(sig.Calls).To(Equal(int64(-1)))
}
