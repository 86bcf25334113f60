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
	"strings"
	"time"

	"github.com/spillway-dev/spillway/internal/proctest"
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
	return proctest.LookPath("redis-server", "REDIS_SERVER", setupHint)
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
