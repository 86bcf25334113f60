// Package protocol is Spillway's Redis protocol, version 5: the keys of one
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

// Version is the protocol version these scripts and calls speak: the
// version of the Lua files, which every script checks against the state
// hash's "version" (lib.lua version_refusal) and writes into the registry of
// worker processes (register.lua).
const Version = 6

// The version skew (docs/protocol.md §10, docs/operations.md "Upgrading"): a
// manager at version N serves workers at N-1 and N, and workers at N work
// under a manager at N-1. The state hash's "version" is the state version:
// what a manager at N writes is N-1, so that workers at N-1 act on it too.
// Workers at N act on what their neighbours' managers write: N-2 (a manager
// one version older), N-1 (their own) and N (one version newer). Version 5
// was the first of the scheme (a manager at 4 wrote 4, as one at 5 does), so
// version 6 acts on state versions 4 (a manager at 5), 5 (its own manager)
// and 6 (a manager at 7), and refuses the rest with a *VersionError.
const (
	// StateVersion is the state hash's "version" that Publish writes.
	StateVersion = Version - 1
	// MinStateVersion and MaxStateVersion bound the state versions this
	// version's scripts act on (lib.lua version_refusal).
	MinStateVersion = Version - 2
	MaxStateVersion = Version
)

// Served reports whether a manager of this version serves workers of
// protocol version v: one version older, its own, and one newer (which acts
// on the state this version writes).
func Served(v int) bool { return v >= Version-1 && v <= Version+1 }

// KeyPrefix starts every key. Its "v4" names the key space, not the
// protocol version: versions 4 and 5 share every key, which is what lets
// their workers share one cap (docs/protocol.md §10). It changes only with a
// version whose keys cannot be shared with its predecessor's.
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
	// Clients is a sorted set of the worker processes that registered in the
	// last 5 minutes (register.lua): "<client> <version> <process id>",
	// scored by the Redis time in ms of their last registration.
	Clients string
	// Calls is a hash of the calls made by workers of each version from 5
	// on, per 10 s bucket ("<bucket's first second>:<version>"): what
	// older workers make is the rest of the stats' calls (versions.lua).
	Calls string
	// Released is a sorted set of the leases released while the dependency
	// learned or had no state, scored by when the record goes (ms): a hold
	// or a renewal that reaches Redis after the release does not put them
	// back (lib.lua remember_released).
	Released string
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
		State:    p + "state",
		Leases:   p + "leases",
		GCRA:     p + "gcra",
		Stats:    p + "stats",
		Probes:   p + "probes",
		Pools:    p + "pools",
		Wants:    p + "wants",
		Callers:  p + "callers",
		Clients:  p + "clients",
		Calls:    p + "calls",
		Released: p + "released",
		Changes:  p + "changes",
		prefix:   p,
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
	holdScript      = script("hold")
	releaseScript   = script("release")
	budgetScript    = script("budget")
	windowScript    = script("window")
	publishScript   = script("publish")
	readScript      = script("read")
	supersedeScript = script("supersede")
	forgetScript    = script("forget")
	poolScript      = script("pool")
	registerScript  = script("register")
	versionsScript  = script("versions")
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

// ErrVersion means the state in Redis was published for a protocol version
// this one does not act on; the error is a *VersionError that says which.
var ErrVersion = errors.New("the state in Redis has a protocol version this worker does not speak")

// VersionError is ErrVersion with the versions on both sides: the state's
// (the oldest protocol version the manager that published it serves) and
// the manager's, against this worker's.
type VersionError struct {
	Dependency Dependency
	// State is the state hash's "version"; -1 when it is not a number.
	State int
	// Manager is the protocol version of the manager that last published;
	// -1 when unknown (a manager of version 4, which does not say).
	Manager int
}

// Error names both versions and what to do.
func (e *VersionError) Error() string {
	manager := "a manager of an unknown protocol version"
	if e.Manager > 0 {
		manager = fmt.Sprintf("a manager at protocol version %d", e.Manager)
	}
	what := "upgrade this worker's Spillway library"
	if e.State >= 0 && e.State < MinStateVersion {
		what = "upgrade the Spillway manager"
	}
	return fmt.Sprintf("%s: the state was published by %s for workers at protocol version %d or later; this worker speaks version %d, which acts on state versions %d to %d: %s (docs/operations.md, Upgrading)",
		e.Dependency, manager, e.State, Version, MinStateVersion, MaxStateVersion, what)
}

// Unwrap makes errors.Is(err, ErrVersion) true.
func (e *VersionError) Unwrap() error { return ErrVersion }

// versionError decodes a refusal {code, state version, manager version}.
func (c *Client) versionError(res []any) error {
	e := &VersionError{Dependency: c.dep, State: -1, Manager: -1}
	if v, err := intAt(res, 1); err == nil {
		e.State = int(v)
	}
	if v, err := intAt(res, 2); err == nil {
		e.Manager = int(v)
	}
	return e
}
