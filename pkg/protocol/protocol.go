// Package protocol is Spillway's Redis protocol, version 4: the keys of one
// dependency, the Lua scripts that change them, and typed Go calls for each.
// docs/protocol.md is its specification; a worker in another language can join
// the fleet by following it.
//
// Every key of a dependency carries the hash tag {namespace/name}, so each
// script touches a single hash slot and works on Redis Cluster. Every
// multi-step operation is one Lua script, run with EVALSHA (EVAL when the
// server answers NOSCRIPT), and time inside scripts comes from Redis TIME.
//
// The package imports go-redis and the standard library only: worker binaries
// that use it stay lean.
package protocol

import (
	"embed"
	"errors"
	"fmt"
	"regexp"
	"strings"

	"github.com/redis/go-redis/v9"
)

// Version is the protocol version. It is part of every key and stored in the
// state hash; acquire and budget, the scripts that act on the policy, refuse
// another version.
const Version = 4

// KeyPrefix starts every key of this protocol version.
const KeyPrefix = "spillway:v4:"

// Outcome is how a call ended, as reported on release.
type Outcome string

const (
	// Success is a call that did what was asked.
	Success Outcome = "s"
	// Failure is a call the dependency failed.
	Failure Outcome = "f"
	// Timeout is a call that did not finish in time.
	Timeout Outcome = "t"
	// Cancelled is a call that ended for a reason of the caller's own: its
	// context was cancelled, the worker shut down, the guarded code
	// panicked, or the lease was lost. It frees the slot and counts nothing
	// against the dependency: not in the breaker window, not in the retry
	// budget's calls. A cancelled HalfOpen probe gives its probe back.
	Cancelled Outcome = "c"
)

// Valid reports whether o is one of the four outcomes.
func (o Outcome) Valid() bool {
	return o == Success || o == Failure || o == Timeout || o == Cancelled
}

// Dependency names one dependency: the namespace and name of its
// DependencyPolicy.
type Dependency struct {
	Namespace string
	Name      string
}

var (
	dns1123Label     = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)
	dns1123Subdomain = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`)
)

// ParseDependency parses "namespace/name".
func ParseDependency(s string) (Dependency, error) {
	ns, name, ok := strings.Cut(s, "/")
	if !ok {
		return Dependency{}, fmt.Errorf("dependency %q must be namespace/name", s)
	}
	d := Dependency{Namespace: ns, Name: name}
	return d, d.Validate()
}

// Validate checks that the namespace is a DNS label and the name a DNS
// subdomain, as Kubernetes requires of a DependencyPolicy.
func (d Dependency) Validate() error {
	if len(d.Namespace) == 0 || len(d.Namespace) > 63 || !dns1123Label.MatchString(d.Namespace) {
		return fmt.Errorf("dependency namespace %q must be a DNS label (lower-case alphanumerics and '-', at most 63)", d.Namespace)
	}
	if len(d.Name) == 0 || len(d.Name) > 253 || !dns1123Subdomain.MatchString(d.Name) {
		return fmt.Errorf("dependency name %q must be a DNS subdomain (lower-case alphanumerics, '-' and '.', at most 253)", d.Name)
	}
	return nil
}

// String is "namespace/name".
func (d Dependency) String() string { return d.Namespace + "/" + d.Name }

// Keys are the Redis keys of one dependency. All share the hash tag
// {namespace/name}.
type Keys struct {
	// State is a hash the controller writes: state, limit and parameters.
	State string
	// Leases is a sorted set of concurrency leases scored by expiry (ms).
	Leases string
	// GCRA holds the rate limiter's theoretical arrival time (µs).
	GCRA string
	// Stats is a hash of per-second outcome counters that workers write.
	Stats string
	// Probes is a hash of the outcomes of the current HalfOpen epoch's probes.
	Probes string
	// Pools is a hash of the batching pools' records: each pool's last
	// request id and reply (answered again to a resend) and the counter of
	// its members (pool.lua).
	Pools string
	// Wants is a hash of live demand for slots: each pool's want, held
	// slots and time, and the time of the last per-call refusal for want
	// of a slot by anonymous per-call callers ("percall"), from which
	// pool.lua computes fair shares.
	Wants string
	// Callers is a sorted set of the per-call callers that named themselves
	// (AcquireArgs.CallerID), scored by the time (ms) of their last refusal
	// for want of a slot, pruned to the last second: each is a contender of
	// its own in the pools' fair split.
	Callers string
	// Changes is the pub/sub channel on which the scripts announce a change
	// of the published state ("<epoch> <state> <limit>"). It is the state
	// key with "state" replaced by "changes" (lib.lua changes_channel).
	Changes string
	prefix  string
}

// KeysFor returns the keys of d. It does not validate d.
func KeysFor(d Dependency) Keys {
	p := KeyPrefix + "{" + d.Namespace + "/" + d.Name + "}:"
	return Keys{
		State:   p + "state",
		Leases:  p + "leases",
		GCRA:    p + "gcra",
		Stats:   p + "stats",
		Probes:  p + "probes",
		Pools:   p + "pools",
		Wants:   p + "wants",
		Callers: p + "callers",
		Changes: p + "changes",
		prefix:  p,
	}
}

// Job is the key that records the newest version of a job key.
func (k Keys) Job(jobKey string) string { return k.prefix + "job:" + jobKey }

//go:embed lua/*.lua
var luaFS embed.FS

func script(name string) *redis.Script {
	lib, err := luaFS.ReadFile("lua/lib.lua")
	if err != nil {
		panic(err)
	}
	body, err := luaFS.ReadFile("lua/" + name + ".lua")
	if err != nil {
		panic(err)
	}
	return redis.NewScript(string(lib) + string(body))
}

// The protocol's scripts. Each is loaded once per Redis server by its first
// EVAL and run by EVALSHA afterwards.
var (
	acquireScript   = script("acquire")
	renewScript     = script("renew")
	releaseScript   = script("release")
	budgetScript    = script("budget")
	windowScript    = script("window")
	publishScript   = script("publish")
	readScript      = script("read")
	supersedeScript = script("supersede")
	forgetScript    = script("forget")
	poolScript      = script("pool")
	noopScript      = func() *redis.Script {
		body, err := luaFS.ReadFile("lua/noop.lua")
		if err != nil {
			panic(err)
		}
		return redis.NewScript(string(body))
	}()
)

// ErrNoPolicy means the controller has not published a policy for the
// dependency: no DependencyPolicy exists, or the controller has not run yet.
var ErrNoPolicy = errors.New("no policy published for this dependency")

// ErrVersion means the state in Redis was written by another protocol version.
var ErrVersion = errors.New("the state in Redis has another protocol version")
