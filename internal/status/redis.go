package status

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisOptions say how to reach the Redis the controller publishes to. The
// flags are named as the manager's (cmd/manager), so the same values work
// for both.
type RedisOptions struct {
	Addrs                []string
	Username             string
	PasswordFile         string
	TLS                  bool
	TLSCAFile            string
	Cluster              bool
	SentinelMaster       string
	SentinelAddrs        []string
	SentinelUsername     string
	SentinelPasswordFile string
	Timeout              time.Duration

	addr, sentinelAddr string
}

// BindFlags defines the Redis flags on fs; call Complete after parsing.
func (o *RedisOptions) BindFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.addr, "redis-addr", "127.0.0.1:6379",
		"Redis address host:port; with --redis-cluster, a comma-separated list of seed nodes. From outside the cluster, port-forward to it.")
	fs.StringVar(&o.Username, "redis-username", "", "Redis ACL user name; empty for the default user.")
	fs.StringVar(&o.PasswordFile, "redis-password-file", "", "File holding the Redis password.")
	fs.BoolVar(&o.TLS, "redis-tls", false, "Connect to Redis with TLS.")
	fs.StringVar(&o.TLSCAFile, "redis-tls-ca-file", "",
		"PEM file of the CA that signed Redis's certificate; the system roots when empty. Implies --redis-tls.")
	fs.BoolVar(&o.Cluster, "redis-cluster", false, "Redis is a Redis Cluster; --redis-addr lists seed nodes.")
	fs.StringVar(&o.SentinelMaster, "redis-sentinel-master", "",
		"Redis is managed by Sentinel, which monitors its master under this name; set --redis-sentinel-addr instead of --redis-addr.")
	fs.StringVar(&o.sentinelAddr, "redis-sentinel-addr", "",
		"Comma-separated host:port addresses of the sentinels, with --redis-sentinel-master.")
	fs.StringVar(&o.SentinelUsername, "redis-sentinel-username", "", "ACL user name for the sentinels, with --redis-sentinel-master.")
	fs.StringVar(&o.SentinelPasswordFile, "redis-sentinel-password-file", "",
		"File holding the sentinels' password, with --redis-sentinel-master.")
	fs.DurationVar(&o.Timeout, "redis-timeout", time.Second,
		"Bound on each Redis operation; an unreachable Redis costs at most this per refresh.")
}

// Complete checks the flags BindFlags defined, after fs was parsed.
func (o *RedisOptions) Complete(fs *flag.FlagSet) error {
	o.Addrs = splitAddrs(o.addr)
	o.SentinelAddrs = splitAddrs(o.sentinelAddr)
	o.TLS = o.TLS || o.TLSCAFile != ""
	addrSet := false
	fs.Visit(func(f *flag.Flag) { addrSet = addrSet || f.Name == "redis-addr" })
	sentinel := o.SentinelMaster != ""
	switch {
	case sentinel && len(o.SentinelAddrs) == 0:
		return errors.New("--redis-sentinel-master needs --redis-sentinel-addr, the sentinels' addresses")
	case !sentinel && len(o.SentinelAddrs) > 0:
		return errors.New("--redis-sentinel-addr needs --redis-sentinel-master, the name the sentinels monitor the master under")
	case sentinel && (addrSet || o.Cluster):
		return errors.New("--redis-sentinel-master excludes --redis-addr and --redis-cluster: the sentinels name the master")
	case sentinel:
		o.Addrs = nil
	case len(o.Addrs) == 0:
		return errors.New("--redis-addr must name at least one address")
	case len(o.Addrs) > 1 && !o.Cluster:
		return fmt.Errorf("--redis-addr lists %d addresses: set --redis-cluster for a Redis Cluster", len(o.Addrs))
	}
	if o.Timeout <= 0 {
		return errors.New("--redis-timeout must be positive")
	}
	return nil
}

// Where names the Redis o points at, for messages.
func (o *RedisOptions) Where() string {
	if o.SentinelMaster != "" {
		return fmt.Sprintf("master %s of sentinels %s", o.SentinelMaster, strings.Join(o.SentinelAddrs, ","))
	}
	return strings.Join(o.Addrs, ",")
}

// NewClient connects to Redis, a Redis Cluster or Sentinel's master, as o
// says; every operation is bounded by o.Timeout.
func (o *RedisOptions) NewClient() (redis.UniversalClient, error) {
	var tlsConfig *tls.Config
	if o.TLS {
		tlsConfig = &tls.Config{MinVersion: tls.VersionTLS12}
		if o.TLSCAFile != "" {
			pem, err := os.ReadFile(o.TLSCAFile)
			if err != nil {
				return nil, fmt.Errorf("failed to read --redis-tls-ca-file: %w", err)
			}
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("--redis-tls-ca-file %s holds no PEM certificate", o.TLSCAFile)
			}
			tlsConfig.RootCAs = pool
		}
	}
	var creds func(context.Context) (string, string, error)
	if o.PasswordFile != "" {
		password, err := readSecret(o.PasswordFile, "--redis-password-file")
		if err != nil {
			return nil, err
		}
		creds = func(context.Context) (string, string, error) { return o.Username, password, nil }
	}
	addrs := o.Addrs
	var sentinelPassword string
	if o.SentinelMaster != "" {
		addrs = o.SentinelAddrs
		if o.SentinelPasswordFile != "" {
			var err error
			if sentinelPassword, err = readSecret(o.SentinelPasswordFile, "--redis-sentinel-password-file"); err != nil {
				return nil, err
			}
		}
	}
	return redis.NewUniversalClient(&redis.UniversalOptions{
		Addrs:                      addrs,
		IsClusterMode:              o.Cluster,
		MasterName:                 o.SentinelMaster,
		SentinelUsername:           o.SentinelUsername,
		SentinelPassword:           sentinelPassword,
		Username:                   o.Username,
		CredentialsProviderContext: creds,
		TLSConfig:                  tlsConfig,
		DialTimeout:                o.Timeout,
		ReadTimeout:                o.Timeout,
		WriteTimeout:               o.Timeout,
		ContextTimeoutEnabled:      true,
		// A status read retried against an unreachable Redis would only
		// wait the timeout out again.
		MaxRetries:    -1,
		DialerRetries: 1,
	}), nil
}

// quietRedis drops go-redis's own log lines (a failed dial): the command
// reports an unreachable Redis itself, once.
type quietRedis struct{}

func (quietRedis) Printf(context.Context, string, ...any) {}

// readSecret reads the secret file named by flag, without the trailing
// newline that editors and `echo` add.
func readSecret(path, flag string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("failed to read %s: %w", flag, err)
	}
	return strings.TrimRight(string(b), "\r\n"), nil
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
