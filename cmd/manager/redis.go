package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"strings"

	"github.com/redis/go-redis/v9"
)

// newRedisClient connects to Redis, to a Redis Cluster, or to the master that
// Sentinel names (a failover client that follows the sentinels' elections), as
// o says.
// Every operation is bounded by o.timeout: the socket timeouts are set to it
// and the client honours context deadlines (the reconciler also gives each
// operation a context with that timeout).
func newRedisClient(o redisOptions) (redis.UniversalClient, error) {
	var tlsConfig *tls.Config
	if o.tls {
		var err error
		if tlsConfig, err = redisTLSConfig(o.tlsCAFile); err != nil {
			return nil, err
		}
	}
	var creds func(context.Context) (string, string, error)
	if o.passwordFile != "" {
		// Fail at start-up on a missing file rather than at the first dial.
		if _, err := readPassword(o.passwordFile); err != nil {
			return nil, err
		}
		creds = func(context.Context) (string, string, error) {
			password, err := readPassword(o.passwordFile)
			return o.username, password, err
		}
	}
	addrs := o.addrs
	var sentinelPassword string
	if o.sentinelMaster != "" {
		addrs = o.sentinelAddrs
		if o.sentinelPasswordFile != "" {
			var err error
			if sentinelPassword, err = readFile(o.sentinelPasswordFile, "--redis-sentinel-password-file"); err != nil {
				return nil, err
			}
		}
	}
	return redis.NewUniversalClient(&redis.UniversalOptions{
		Addrs:                      addrs,
		IsClusterMode:              o.cluster,
		MasterName:                 o.sentinelMaster,
		SentinelUsername:           o.sentinelUsername,
		SentinelPassword:           sentinelPassword,
		Username:                   o.username,
		CredentialsProviderContext: creds,
		TLSConfig:                  tlsConfig,
		DialTimeout:                o.timeout,
		ReadTimeout:                o.timeout,
		WriteTimeout:               o.timeout,
		ContextTimeoutEnabled:      true,
	}), nil
}

// redisTLSConfig trusts the CA in caFile, or the system roots when empty.
func redisTLSConfig(caFile string) (*tls.Config, error) {
	c := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile == "" {
		return c, nil
	}
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("failed to read --redis-tls-ca-file: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("--redis-tls-ca-file %s holds no PEM certificate", caFile)
	}
	c.RootCAs = pool
	return c, nil
}

// readPassword reads a password file, without the trailing newline that
// editors and `echo` add.
func readPassword(path string) (string, error) {
	return readFile(path, "--redis-password-file")
}

// readFile reads the secret file named by flag, without the trailing newline
// that editors and `echo` add.
func readFile(path, flag string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("failed to read %s: %w", flag, err)
	}
	return strings.TrimRight(string(b), "\r\n"), nil
}
