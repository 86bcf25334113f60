// Command manager runs Spillway's controller: it evaluates every
// DependencyPolicy each interval, publishes the fleet's limit to Redis and
// bounds the consumers' KEDA ScaledObjects.
//
// Flags parse into an options struct, and run does the rest.
package main

import (
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
)

// options are the manager's command line.
type options struct {
	metricsAddr             string
	metricsSecure           bool
	enableHTTP2             bool
	probeAddr               string
	leaderElect             bool
	leaderElectionNamespace string
	leaseDuration           time.Duration
	renewDeadline           time.Duration
	retryPeriod             time.Duration
	kubeAPIQPS              float64
	kubeAPIBurst            int

	evaluationInterval      time.Duration
	statusInterval          time.Duration
	maxConcurrentReconciles int

	redis   redisOptions
	webhook webhookOptions
	zap     zap.Options
}

// redisOptions say how to reach Redis.
type redisOptions struct {
	addrs        []string
	username     string
	passwordFile string
	tls          bool
	tlsCAFile    string
	cluster      bool
	timeout      time.Duration

	// sentinelMaster, when set, is the name under which the sentinels at
	// sentinelAddrs monitor the master; addrs is then unused.
	sentinelMaster string
	sentinelAddrs  []string
	// sentinelUsername and sentinelPasswordFile authenticate to the
	// sentinels themselves, which may have credentials of their own.
	sentinelUsername     string
	sentinelPasswordFile string

	// allowEviction lets the manager start on a Redis that evicts keys
	// (--redis-allow-eviction).
	allowEviction bool
}

func main() {
	opts, err := parseFlags(flag.CommandLine, os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	ctrl.SetLogger(zap.New(zap.UseFlagOptions(&opts.zap)))
	if err := run(ctrl.SetupSignalHandler(), opts); err != nil {
		ctrl.Log.WithName("setup").Error(err, "Manager exited with an error")
		os.Exit(1)
	}
}

// parseFlags reads the command line into options.
func parseFlags(fs *flag.FlagSet, args []string) (options, error) {
	var o options
	var redisAddr, sentinelAddr string
	fs.StringVar(&o.metricsAddr, "metrics-bind-address", "0",
		"Address the metrics endpoint binds to, e.g. :8443 (HTTPS) or :8080 (with --metrics-secure=false); 0 disables it.")
	fs.BoolVar(&o.metricsSecure, "metrics-secure", true,
		"Serve metrics over HTTPS, authenticating and authorising each scrape with TokenReviews and SubjectAccessReviews.")
	fs.BoolVar(&o.enableHTTP2, "enable-http2", false,
		"Allow HTTP/2 on the metrics server; off by default against the HTTP/2 stream-cancellation and rapid-reset CVEs.")
	fs.StringVar(&o.probeAddr, "health-probe-bind-address", ":8081", "Address the /healthz and /readyz probes bind to.")
	fs.BoolVar(&o.leaderElect, "leader-elect", true,
		"Elect a leader (Lease spillway.dev) so that only one manager replica publishes limits.")
	fs.StringVar(&o.leaderElectionNamespace, "leader-election-namespace", "",
		"Namespace of the leader-election Lease; defaults to the manager's own namespace in a cluster.")
	fs.DurationVar(&o.leaseDuration, "leader-election-lease-duration", 15*time.Second,
		"How long a standby waits after the leader's last renewal before it takes the Lease: the bound on a handover after the leader dies without releasing it.")
	fs.DurationVar(&o.renewDeadline, "leader-election-renew-deadline", 10*time.Second,
		"How long the leader keeps trying to renew the Lease before it stops leading; shorter than the lease duration.")
	fs.DurationVar(&o.retryPeriod, "leader-election-retry-period", 500*time.Millisecond,
		"How often the leader renews the Lease and a standby tries to take it (each wait jittered up to 2.2 times this); a leader that stops releases the Lease, and a standby takes it within about twice this.")
	fs.Float64Var(&o.kubeAPIQPS, "kube-api-qps", 100,
		"Queries per second the manager may send the API server; status writes grow with the number of policies.")
	fs.IntVar(&o.kubeAPIBurst, "kube-api-burst", 200, "Burst of queries the manager may send the API server.")
	fs.DurationVar(&o.evaluationInterval, "evaluation-interval", time.Second,
		"How often each DependencyPolicy is evaluated: read the workers' outcomes, step the breaker and ramp, publish the limit.")
	fs.DurationVar(&o.statusInterval, "status-interval", 10*time.Second,
		"How stale a policy's status.window may get before it is written again; state, limit and condition changes are written at once.")
	fs.IntVar(&o.maxConcurrentReconciles, "max-concurrent-reconciles", 8, "How many policies are evaluated at once (at least 4).")
	fs.StringVar(&redisAddr, "redis-addr", "127.0.0.1:6379",
		"Redis address host:port; with --redis-cluster, a comma-separated list of seed nodes.")
	fs.StringVar(&o.redis.username, "redis-username", "", "Redis ACL user name; empty for the default user.")
	fs.StringVar(&o.redis.passwordFile, "redis-password-file", "",
		"File holding the Redis password, typically a Secret key mounted as a file; it is read again for every new connection, so a rotated Secret applies without a restart.")
	fs.BoolVar(&o.redis.tls, "redis-tls", false, "Connect to Redis with TLS.")
	fs.StringVar(&o.redis.tlsCAFile, "redis-tls-ca-file", "",
		"PEM file of the CA that signed Redis's certificate; the system roots when empty. Implies --redis-tls.")
	fs.BoolVar(&o.redis.cluster, "redis-cluster", false, "Redis is a Redis Cluster; --redis-addr lists seed nodes.")
	fs.BoolVar(&o.redis.allowEviction, "redis-allow-eviction", false,
		"Start even when Redis evicts keys (a maxmemory-policy other than noeviction, on any master), which the manager refuses by default: leases and the published state may then disappear under memory pressure. Sets the spillway_redis_evicting gauge to 1.")
	fs.StringVar(&o.redis.sentinelMaster, "redis-sentinel-master", "",
		"Redis is managed by Sentinel, which monitors its master under this name; set --redis-sentinel-addr instead of --redis-addr.")
	fs.StringVar(&sentinelAddr, "redis-sentinel-addr", "",
		"Comma-separated host:port addresses of the sentinels, with --redis-sentinel-master. The manager asks them for the master and follows a failover.")
	fs.StringVar(&o.redis.sentinelUsername, "redis-sentinel-username", "",
		"ACL user name for the sentinels, with --redis-sentinel-master; empty for the default user.")
	fs.StringVar(&o.redis.sentinelPasswordFile, "redis-sentinel-password-file", "",
		"File holding the sentinels' password, with --redis-sentinel-master (mount it from a Secret). Read at start-up: restart the manager after rotating it.")
	fs.DurationVar(&o.redis.timeout, "redis-timeout", 500*time.Millisecond,
		"Bound on each Redis operation, so an unreachable Redis never holds up other policies.")
	o.webhook.bindFlags(fs)
	o.zap.BindFlags(fs)
	if err := fs.Parse(args); err != nil {
		return options{}, err
	}
	o.redis.addrs = splitAddrs(redisAddr)
	o.redis.sentinelAddrs = splitAddrs(sentinelAddr)
	addrSet := false
	fs.Visit(func(f *flag.Flag) { addrSet = addrSet || f.Name == "redis-addr" })
	sentinel := o.redis.sentinelMaster != ""
	switch {
	case sentinel && len(o.redis.sentinelAddrs) == 0:
		return options{}, fmt.Errorf("--redis-sentinel-master needs --redis-sentinel-addr, the sentinels' addresses")
	case !sentinel && len(o.redis.sentinelAddrs) > 0:
		return options{}, fmt.Errorf("--redis-sentinel-addr needs --redis-sentinel-master, the name the sentinels monitor the master under")
	case !sentinel && (o.redis.sentinelUsername != "" || o.redis.sentinelPasswordFile != ""):
		return options{}, fmt.Errorf("--redis-sentinel-username and --redis-sentinel-password-file need --redis-sentinel-master")
	case sentinel && (addrSet || o.redis.cluster):
		return options{}, fmt.Errorf("--redis-sentinel-master excludes --redis-addr and --redis-cluster: the sentinels name the master")
	case sentinel:
		o.redis.addrs = nil
	case len(o.redis.addrs) == 0:
		return options{}, fmt.Errorf("--redis-addr must name at least one address")
	case len(o.redis.addrs) > 1 && !o.redis.cluster:
		return options{}, fmt.Errorf("--redis-addr lists %d addresses: set --redis-cluster for a Redis Cluster", len(o.redis.addrs))
	case o.evaluationInterval <= 0 || o.statusInterval <= 0 || o.redis.timeout <= 0:
		return options{}, fmt.Errorf("--evaluation-interval, --status-interval and --redis-timeout must be positive")
	case o.leaseDuration <= o.renewDeadline || o.renewDeadline <= o.retryPeriod*6/5 || o.retryPeriod <= 0:
		return options{}, fmt.Errorf("leader election needs --leader-election-lease-duration (%s) > --leader-election-renew-deadline (%s) > 1.2 x --leader-election-retry-period (%s) > 0",
			o.leaseDuration, o.renewDeadline, o.retryPeriod)
	case o.maxConcurrentReconciles < 4:
		return options{}, fmt.Errorf("--max-concurrent-reconciles must be at least 4, got %d", o.maxConcurrentReconciles)
	}
	if o.redis.tlsCAFile != "" {
		o.redis.tls = true
	}
	return o, nil
}

// splitAddrs splits a comma-separated list of addresses, dropping blanks.
func splitAddrs(list string) []string {
	var addrs []string
	for a := range strings.SplitSeq(list, ",") {
		if a = strings.TrimSpace(a); a != "" {
			addrs = append(addrs, a)
		}
	}
	return addrs
}
