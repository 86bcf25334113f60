package main

import (
	"context"
	"crypto/tls"
	"fmt"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	crmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"
	"sigs.k8s.io/controller-runtime/pkg/metrics/filters"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/controllers"
)

// run starts the manager and blocks until ctx ends or the manager fails.
func run(ctx context.Context, o options) error {
	log := ctrl.Log.WithName("setup")

	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{
		clientgoscheme.AddToScheme,
		spillwayv1alpha1.AddToScheme,
		kedav1alpha1.AddToScheme,
	} {
		if err := add(scheme); err != nil {
			return fmt.Errorf("failed to build the scheme: %w", err)
		}
	}

	rdb, err := newRedisClient(o.redis)
	if err != nil {
		return err
	}
	defer rdb.Close()
	if err := checkRedisEviction(ctx, rdb, o.redis, crmetrics.Registry); err != nil {
		return err
	}

	cfg, err := ctrl.GetConfig()
	if err != nil {
		return fmt.Errorf("failed to load the kubeconfig: %w", err)
	}
	cfg.QPS, cfg.Burst = float32(o.kubeAPIQPS), o.kubeAPIBurst

	metricsOpts := metricsserver.Options{
		BindAddress:   o.metricsAddr,
		SecureServing: o.metricsSecure,
	}
	if o.metricsSecure {
		// As kubebuilder v4 scaffolds it: HTTPS with a self-signed
		// certificate, and every scrape authenticated and authorised.
		metricsOpts.FilterProvider = filters.WithAuthenticationAndAuthorization
	}
	if !o.enableHTTP2 {
		metricsOpts.TLSOpts = append(metricsOpts.TLSOpts, func(c *tls.Config) { c.NextProtos = []string{"http/1.1"} })
	}

	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Scheme:                        scheme,
		Metrics:                       metricsOpts,
		HealthProbeBindAddress:        o.probeAddr,
		LeaderElection:                o.leaderElect,
		LeaderElectionID:              "spillway.dev",
		LeaderElectionNamespace:       o.leaderElectionNamespace,
		LeaderElectionReleaseOnCancel: true,
		LeaseDuration:                 &o.leaseDuration,
		RenewDeadline:                 &o.renewDeadline,
		RetryPeriod:                   &o.retryPeriod,
		WebhookServer:                 o.webhook.server(o.enableHTTP2),
	})
	if err != nil {
		return fmt.Errorf("failed to create the manager: %w", err)
	}
	if err := mgr.AddHealthzCheck("healthz", healthz.Ping); err != nil {
		return fmt.Errorf("failed to add the health check: %w", err)
	}
	if err := mgr.AddReadyzCheck("readyz", healthz.Ping); err != nil {
		return fmt.Errorf("failed to add the readiness check: %w", err)
	}

	// The evaluator publishes each policy's limit to Redis; the policy
	// reconciler writes status and bounds the consumers from what the
	// evaluator remembers in the store they share.
	opts := controllers.Options{
		EvaluationInterval:      o.evaluationInterval,
		StatusInterval:          o.statusInterval,
		RedisTimeout:            o.redis.timeout,
		MaxConcurrentReconciles: o.maxConcurrentReconciles,
	}
	evaluations := controllers.NewEvaluations()
	evaluator := &controllers.Evaluator{Redis: rdb, Evaluations: evaluations, Options: opts}
	if err := evaluator.SetupWithManager(ctx, mgr); err != nil {
		return fmt.Errorf("failed to set up the DependencyPolicy evaluator: %w", err)
	}
	reconciler := &controllers.PolicyReconciler{Redis: rdb, Evaluations: evaluations, Options: opts}
	if err := reconciler.SetupWithManager(ctx, mgr); err != nil {
		return fmt.Errorf("failed to set up the DependencyPolicy controller: %w", err)
	}

	if err := setupWebhook(mgr, o.webhook); err != nil {
		return err
	}

	log.Info("Starting the manager", "redis", o.redis.addrs, "redisCluster", o.redis.cluster,
		"redisSentinelMaster", o.redis.sentinelMaster, "redisSentinels", o.redis.sentinelAddrs,
		"evaluationInterval", o.evaluationInterval, "leaderElection", o.leaderElect,
		"leaseDuration", o.leaseDuration, "renewDeadline", o.renewDeadline, "retryPeriod", o.retryPeriod)
	if err := mgr.Start(ctx); err != nil {
		return fmt.Errorf("manager stopped: %w", err)
	}
	return nil
}
