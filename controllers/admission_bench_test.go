package controllers

import (
	"context"
	"slices"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// BenchmarkWebhookLatency measures what the validating webhook adds to
// requests on a Deployment no policy names: an update of spec.replicas
// (the objectSelector keeps the API server from calling the webhook) and a
// kubectl scale (the scale webhook is called, and allows it from its cache).
// Each is timed SPILLWAY_BENCH_REQUESTS times (default 200) with the webhook
// installed and serving, then with it removed, alternately in rounds of 20
// so that the machine's noise falls on both alike. Run with -benchtime=1x.
func BenchmarkWebhookLatency(b *testing.B) {
	n := benchEnvInt("SPILLWAY_BENCH_REQUESTS", 200)
	ns := newNamespace(b)
	ctx := context.Background()
	createDeployment(b, ns, "unrelated", 1)
	opts := installWebhook(b)
	startWebhook(b, ns, opts)
	cfg := opts.ValidatingWebhooks[0]

	update := func(i int) error {
		d := &appsv1.Deployment{}
		if err := env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: "unrelated"}, d); err != nil {
			return err
		}
		d.Spec.Replicas = ptr.To(int32(1 + i%5))
		return env.Client.Update(ctx, d)
	}
	scale := func(i int) error { return kubectlScale(ns, "unrelated", int32(1+i%5)) }
	kinds := []struct {
		name string
		do   func(int) error
	}{{"update", update}, {"scale", scale}}

	// Wait until the webhook answers (a scale goes through it).
	for range 50 {
		if scale(0) == nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	times := map[string][]time.Duration{}
	installed := true
	for round := 0; round < 2*n/20; round++ {
		want := round%2 == 0
		if want != installed {
			if want {
				cfg.ResourceVersion, cfg.UID = "", ""
				if err := env.Client.Create(ctx, cfg); err != nil {
					b.Fatal(err)
				}
			} else if err := env.Client.Delete(ctx, cfg); err != nil {
				b.Fatal(err)
			}
			installed = want
			time.Sleep(time.Second) // the API server's webhook informer catches up
		}
		for _, k := range kinds {
			for i := range 20 {
				start := time.Now()
				if err := k.do(i); err != nil {
					b.Fatal(err)
				}
				key := k.name + map[bool]string{true: "-webhook", false: "-none"}[installed]
				times[key] = append(times[key], time.Since(start))
			}
		}
	}
	for _, key := range []string{"update-none", "update-webhook", "scale-none", "scale-webhook"} {
		t := times[key]
		slices.Sort(t)
		b.ReportMetric(float64(percentile(t, 0.5).Microseconds())/1000, key+"-p50-ms")
		b.ReportMetric(float64(percentile(t, 0.95).Microseconds())/1000, key+"-p95-ms")
	}
}
