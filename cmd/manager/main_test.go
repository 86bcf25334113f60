package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"flag"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
)

func TestParseFlags(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		wantErr string
		check   func(t *testing.T, o options)
	}{
		{name: "defaults", check: func(t *testing.T, o options) {
			if !o.leaderElect || o.evaluationInterval != time.Second || o.statusInterval != 10*time.Second ||
				o.redis.timeout != 500*time.Millisecond || o.maxConcurrentReconciles != 8 ||
				strings.Join(o.redis.addrs, ",") != "127.0.0.1:6379" || o.redis.cluster || o.metricsAddr != "0" || !o.metricsSecure ||
				o.leaseDuration != 15*time.Second || o.renewDeadline != 10*time.Second || o.retryPeriod != 500*time.Millisecond {
				t.Errorf("unexpected defaults: %+v", o)
			}
		}},
		{name: "cluster seeds", args: []string{"--redis-cluster", "--redis-addr=a:1, b:2,c:3"}, check: func(t *testing.T, o options) {
			if got := strings.Join(o.redis.addrs, ","); got != "a:1,b:2,c:3" {
				t.Errorf("addrs = %s", got)
			}
		}},
		{name: "a CA file implies TLS", args: []string{"--redis-tls-ca-file=/ca.pem"}, check: func(t *testing.T, o options) {
			if !o.redis.tls {
				t.Error("tls = false, want true")
			}
		}},
		{name: "several addresses need --redis-cluster", args: []string{"--redis-addr=a:1,b:2"}, wantErr: "--redis-cluster"},
		{name: "no address", args: []string{"--redis-addr= , "}, wantErr: "at least one address"},
		{name: "too few workers", args: []string{"--max-concurrent-reconciles=2"}, wantErr: "at least 4"},
		{name: "zero interval", args: []string{"--evaluation-interval=0s"}, wantErr: "must be positive"},
		{name: "sentinel", args: []string{"--redis-sentinel-master=mymaster", "--redis-sentinel-addr=s1:26379, s2:26379,s3:26379"},
			check: func(t *testing.T, o options) {
				if o.redis.sentinelMaster != "mymaster" || strings.Join(o.redis.sentinelAddrs, ",") != "s1:26379,s2:26379,s3:26379" ||
					o.redis.addrs != nil || o.redis.cluster {
					t.Errorf("redis options = %+v", o.redis)
				}
			}},
		{name: "a sentinel master needs sentinels", args: []string{"--redis-sentinel-master=mymaster"}, wantErr: "needs --redis-sentinel-addr"},
		{name: "blank sentinels", args: []string{"--redis-sentinel-master=m", "--redis-sentinel-addr= ,"}, wantErr: "needs --redis-sentinel-addr"},
		{name: "sentinels need a master name", args: []string{"--redis-sentinel-addr=s1:26379"}, wantErr: "needs --redis-sentinel-master"},
		{name: "sentinel excludes --redis-addr", args: []string{"--redis-sentinel-master=m", "--redis-sentinel-addr=s1:26379", "--redis-addr=r:6379"},
			wantErr: "excludes --redis-addr"},
		{name: "sentinel excludes --redis-cluster", args: []string{"--redis-sentinel-master=m", "--redis-sentinel-addr=s1:26379", "--redis-cluster"},
			wantErr: "excludes --redis-addr and --redis-cluster"},
		{name: "sentinel credentials need sentinels", args: []string{"--redis-sentinel-password-file=/p"}, wantErr: "need --redis-sentinel-master"},
		{name: "sentinel credentials", args: []string{"--redis-sentinel-master=m", "--redis-sentinel-addr=s1:26379",
			"--redis-sentinel-username=spill", "--redis-sentinel-password-file=/secret/pass"}, check: func(t *testing.T, o options) {
			if o.redis.sentinelUsername != "spill" || o.redis.sentinelPasswordFile != "/secret/pass" {
				t.Errorf("sentinel credentials = %q, %q", o.redis.sentinelUsername, o.redis.sentinelPasswordFile)
			}
		}},
		{name: "leader election timings", args: []string{"--leader-election-lease-duration=4s", "--leader-election-renew-deadline=3s",
			"--leader-election-retry-period=200ms"}, check: func(t *testing.T, o options) {
			if o.leaseDuration != 4*time.Second || o.renewDeadline != 3*time.Second || o.retryPeriod != 200*time.Millisecond {
				t.Errorf("lease %s, renew %s, retry %s", o.leaseDuration, o.renewDeadline, o.retryPeriod)
			}
		}},
		{name: "renew deadline not under the lease", args: []string{"--leader-election-renew-deadline=15s"}, wantErr: "lease-duration (15s) > --leader-election-renew-deadline (15s)"},
		{name: "retry period too long for the renew deadline", args: []string{"--leader-election-retry-period=9s"}, wantErr: "> 1.2 x --leader-election-retry-period (9s)"},
		{name: "zero retry period", args: []string{"--leader-election-retry-period=0s"}, wantErr: "retry-period (0s) > 0"},
		{name: "the webhook is off unless asked for", check: func(t *testing.T, o options) {
			if o.webhook.enabled || o.webhook.port != 9443 || !o.webhook.rotate || o.webhook.secret != "spillway-webhook-server-cert" ||
				o.webhook.service != "spillway-webhook-service" || o.webhook.config != "spillway-validating-webhook-configuration" {
				t.Errorf("webhook options = %+v", o.webhook)
			}
		}},
		{name: "the chart's webhook flags", args: []string{"--webhook", "--webhook-port=9444", "--webhook-cert-rotation=false",
			"--webhook-cert-dir=/certs", "--webhook-namespace=ops"}, check: func(t *testing.T, o options) {
			if !o.webhook.enabled || o.webhook.port != 9444 || o.webhook.rotate || o.webhook.certDir != "/certs" || o.webhook.namespace != "ops" {
				t.Errorf("webhook options = %+v", o.webhook)
			}
		}},
		{name: "leader election can be turned off", args: []string{"--leader-elect=false"}, check: func(t *testing.T, o options) {
			if o.leaderElect {
				t.Error("leaderElect = true")
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fs := flag.NewFlagSet("manager", flag.ContinueOnError)
			o, err := parseFlags(fs, tt.args)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("parseFlags(%v) error = %v, want %q", tt.args, err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("parseFlags(%v): %v", tt.args, err)
			}
			tt.check(t, o)
		})
	}
}

// TestRedisPasswordFile starts Redis with a password, and checks that the
// client reads the password file, again for each new connection.
func TestRedisPasswordFile(t *testing.T) {
	// redistest cannot start a server with a password (its readiness check
	// does not authenticate), so the password is set once it runs.
	srv := redistest.Start(t)
	ctx := context.Background()
	if err := srv.Client().ConfigSet(ctx, "requirepass", "first").Err(); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "password")
	if err := os.WriteFile(path, []byte("first\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	rdb, err := newRedisClient(redisOptions{addrs: []string{srv.Addr()}, passwordFile: path, timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	if err := rdb.Ping(ctx).Err(); err != nil {
		t.Fatalf("ping with the password from the file: %v", err)
	}

	// The Secret is rotated: the server and the file change, and the next
	// connection uses the new password.
	admin := srv.Client(func(o *redis.Options) { o.Password = "first" })
	if err := admin.ConfigSet(ctx, "requirepass", "second").Err(); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte("second"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := rdb.(*redis.Client).Conn().Ping(ctx).Err(); err != nil {
		t.Fatalf("ping on a new connection after the rotation: %v", err)
	}

	if _, err := newRedisClient(redisOptions{addrs: []string{srv.Addr()}, passwordFile: filepath.Join(dir, "missing")}); err == nil {
		t.Error("a missing password file is not reported at start-up")
	}
}

func TestRedisTLSConfig(t *testing.T) {
	dir := t.TempDir()
	if _, err := redisTLSConfig(filepath.Join(dir, "missing.pem")); err == nil {
		t.Error("a missing CA file is accepted")
	}
	bad := filepath.Join(dir, "bad.pem")
	if err := os.WriteFile(bad, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := redisTLSConfig(bad); err == nil || !strings.Contains(err.Error(), "no PEM certificate") {
		t.Errorf("a file without a certificate: error = %v", err)
	}

	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "redis-ca"}, NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	ca := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := redisTLSConfig(ca)
	if err != nil {
		t.Fatal(err)
	}
	if c.RootCAs == nil || c.MinVersion == 0 {
		t.Errorf("config = %+v, want the CA as root and a minimum version", c)
	}
	if c, err := redisTLSConfig(""); err != nil || c.RootCAs != nil {
		t.Errorf("without a CA file: %+v, %v; want the system roots", c, err)
	}
}

func TestRedisClusterClient(t *testing.T) {
	rdb, err := newRedisClient(redisOptions{addrs: []string{"127.0.0.1:1", "127.0.0.1:2"}, cluster: true, timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	if _, ok := rdb.(*redis.ClusterClient); !ok {
		t.Errorf("client is %T, want a *redis.ClusterClient", rdb)
	}
}

// TestRedisSentinelClient connects through real sentinels, and follows them
// to the new master after the old one is killed.
func TestRedisSentinelClient(t *testing.T) {
	s := redistest.StartSentinel(t)
	o, err := parseFlags(flag.NewFlagSet("manager", flag.ContinueOnError), []string{
		"--redis-sentinel-master=" + s.MasterName(), "--redis-sentinel-addr=" + strings.Join(s.SentinelAddrs(), ","),
	})
	if err != nil {
		t.Fatal(err)
	}
	rdb, err := newRedisClient(o.redis)
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := rdb.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("set through the sentinels' master: %v", err)
	}
	old, err := s.KillMaster(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.WaitFailover(ctx, old.Addr()); err != nil {
		t.Fatal(err)
	}
	// The client may still hold connections to the dead master: the first
	// commands after the switch can fail, but not for long.
	for {
		err := rdb.Set(ctx, "k", "after", 0).Err()
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("set after the failover: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestRedisSentinelPassword reaches the master through sentinels that require
// a password of their own, read from --redis-sentinel-password-file; without
// it the sentinels refuse to name the master.
func TestRedisSentinelPassword(t *testing.T) {
	s := redistest.StartSentinel(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, addr := range s.SentinelAddrs() {
		admin := redis.NewClient(&redis.Options{Addr: addr})
		err := admin.Do(ctx, "ACL", "SETUSER", "default", "on", ">sentinel-secret").Err()
		admin.Close()
		if err != nil {
			t.Fatalf("set the password of sentinel %s: %v", addr, err)
		}
	}
	path := filepath.Join(t.TempDir(), "sentinel-password")
	if err := os.WriteFile(path, []byte("sentinel-secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	connect := func(extra ...string) error {
		args := append([]string{"--redis-sentinel-master=" + s.MasterName(), "--redis-sentinel-addr=" + strings.Join(s.SentinelAddrs(), ","),
			"--redis-timeout=1s"}, extra...)
		o, err := parseFlags(flag.NewFlagSet("manager", flag.ContinueOnError), args)
		if err != nil {
			t.Fatal(err)
		}
		rdb, err := newRedisClient(o.redis)
		if err != nil {
			t.Fatal(err)
		}
		defer rdb.Close()
		return rdb.Set(ctx, "k", "v", 0).Err()
	}
	if err := connect(); err == nil {
		t.Fatal("reached the master through password-protected sentinels without their password")
	}
	if err := connect("--redis-sentinel-password-file=" + path); err != nil {
		t.Fatalf("set through password-protected sentinels: %v", err)
	}
	if _, err := newRedisClient(redisOptions{sentinelMaster: "m", sentinelAddrs: []string{"127.0.0.1:1"},
		sentinelPasswordFile: filepath.Join(t.TempDir(), "missing")}); err == nil {
		t.Error("a missing sentinel password file was accepted")
	}
}

// The manager refuses to start on a Redis that evicts keys, unless
// --redis-allow-eviction is set: then it starts, and the
// spillway_redis_evicting gauge says 1.
func TestManagerRefusesARedisThatEvictsKeys(t *testing.T) {
	evicting := redistest.Start(t, redistest.WithArgs("--maxmemory-policy", "allkeys-lru"))
	reg := prometheus.NewRegistry()
	rdb, err := newRedisClient(redisOptions{addrs: []string{evicting.Addr()}, timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	err = checkRedisEviction(t.Context(), rdb, redisOptions{timeout: time.Second}, reg)
	if err == nil || !strings.Contains(err.Error(), "allkeys-lru") || !strings.Contains(err.Error(), "--redis-allow-eviction") {
		t.Fatalf("checkRedisEviction = %v, want a refusal naming the policy and the flag", err)
	}
	if err := checkRedisEviction(t.Context(), rdb, redisOptions{timeout: time.Second, allowEviction: true}, reg); err != nil {
		t.Fatalf("checkRedisEviction with --redis-allow-eviction = %v", err)
	}
	if v := testutil.ToFloat64(evictingGauge); v != 1 {
		t.Errorf("spillway_redis_evicting = %v, want 1", v)
	}

	keeping := redistest.Start(t).Client()
	if err := checkRedisEviction(t.Context(), keeping, redisOptions{timeout: time.Second}, prometheus.NewRegistry()); err != nil {
		t.Fatalf("checkRedisEviction = %v on a Redis that keeps every key", err)
	}
	if v := testutil.ToFloat64(evictingGauge); v != 0 {
		t.Errorf("spillway_redis_evicting = %v, want 0", v)
	}
}
