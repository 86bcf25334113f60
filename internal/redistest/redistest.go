// Package redistest runs real redis-server processes for tests and demos.
//
// Every server listens on 127.0.0.1 on a free port, keeps its files in its
// own temporary directory and persists nothing, so test packages never share
// state. [Start], [StartCluster] and [StartSentinel] tie the processes to a
// test and stop them in its cleanup; [StartServer], [NewCluster] and
// [NewSentinel] do the same for callers without a testing.TB, who must call
// Close themselves.
//
// The redis-server binary is taken from the REDIS_SERVER environment variable,
// else from PATH, else /usr/bin/redis-server. Run hack/setup-redis.sh to
// install it. Redis 7 or newer is required for clusters. Sentinels run
// $REDIS_SENTINEL, else redis-sentinel from PATH, else redis-server with
// --sentinel (the same program).
package redistest

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"time"
)

// startTimeout bounds how long a server may take to answer its first PING.
const startTimeout = 10 * time.Second

// setupHint tells a reader how to get redis-server onto the machine.
const setupHint = "run hack/setup-redis.sh to install redis-server"

// Option configures a server started by [StartServer] or [NewCluster].
type Option func(*config)

type config struct {
	binary    string   // redis-server path; found by lookupBinary when empty
	extraArgs []string // appended to the command line
	cluster   bool     // start in cluster mode
}

// WithBinary uses the redis-server at path instead of looking it up.
func WithBinary(path string) Option {
	return func(c *config) { c.binary = path }
}

// WithArgs appends redis-server command-line arguments, such as
// "--maxmemory", "10mb". They are applied after the package's defaults and
// therefore override them.
func WithArgs(args ...string) Option {
	return func(c *config) { c.extraArgs = append(c.extraArgs, args...) }
}

func newConfig(opts []Option) (config, error) {
	var c config
	for _, opt := range opts {
		opt(&c)
	}
	if c.binary == "" {
		bin, err := lookupBinary()
		if err != nil {
			return c, err
		}
		c.binary = bin
	}
	return c, nil
}

// lookupBinary finds redis-server: $REDIS_SERVER, then PATH, then
// /usr/bin/redis-server.
func lookupBinary() (string, error) {
	if bin := os.Getenv("REDIS_SERVER"); bin != "" {
		if _, err := os.Stat(bin); err != nil {
			return "", fmt.Errorf("REDIS_SERVER=%s: %w", bin, err)
		}
		return bin, nil
	}
	if bin, err := exec.LookPath("redis-server"); err == nil {
		return bin, nil
	}
	const fallback = "/usr/bin/redis-server"
	if _, err := os.Stat(fallback); err == nil {
		return fallback, nil
	}
	return "", errors.New("redis-server not found in $REDIS_SERVER, on PATH or at " + fallback + ": " + setupHint)
}

// freePort asks the kernel for a free loopback port. Another process may
// take it before redis-server binds it; callers retry when that happens.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// tail returns the last n lines of the file at path, or a note saying why
// it cannot.
func tail(path string, n int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(cannot read %s: %v)", path, err)
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// infoField returns the value of key in the "key:value" lines that INFO and
// CLUSTER INFO reply with, or "" if key is absent.
func infoField(info, key string) string {
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), key+":"); ok {
			return v
		}
	}
	return ""
}
