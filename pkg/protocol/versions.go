package protocol

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
)

// RegisterEvery is how often a worker process registers (Register): often
// enough that a process seen in the last minute (Fleet) is one that runs.
const RegisterEvery = 15 * time.Second

// Register records that the process processID runs client (go, python, node,
// ...; no spaces) at this protocol version, so that the manager and
// `spillway status` can tell which versions the dependency's fleet speaks
// (register.lua). A process calls it when it starts using the dependency and
// every RegisterEvery after; it is idempotent.
func (c *Client) Register(ctx context.Context, client, processID string) error {
	if client == "" || processID == "" || strings.ContainsAny(client+processID, " \t\n") {
		return fmt.Errorf("client %q and process id %q must be non-empty and without spaces", client, processID)
	}
	if err := registerScript.Run(ctx, c.rdb, []string{c.keys.Clients}, client, processID).Err(); err != nil {
		return fmt.Errorf("failed to register %s process %s for %s: %w", client, processID, c.dep, err)
	}
	return nil
}

// Process is a group of registered worker processes: those of one client at
// one protocol version.
type Process struct {
	Client  string
	Version int
}

// Fleet is which protocol versions a dependency's workers speak, as
// versions.lua reads it.
type Fleet struct {
	// Processes counts the worker processes that registered in the last
	// minute, by client and version. Workers of version 4 and older do not
	// register.
	Processes map[Process]int
	// From and Calls are the calls (successes, failures and timeouts) of
	// the minute [From, From+1m), the six whole 10 s buckets before now.
	From  time.Time
	Calls int64
	// CallsByVersion counts the calls of the same minute that workers of
	// each version from 5 on made; Calls less their sum is what older
	// workers made (Unversioned).
	CallsByVersion map[int]int64
	// Now is Redis's time of the read.
	Now time.Time
}

// Unversioned is the minute's calls that no worker of version 5 or later
// made: those of older workers.
func (f Fleet) Unversioned() int64 {
	n := f.Calls
	for _, c := range f.CallsByVersion {
		n -= c
	}
	return max(0, n)
}

// Versions lists the protocol versions seen in the last minute, registered
// or calling, oldest first; 4 stands for the unversioned calls of workers of
// version 4 or older.
func (f Fleet) Versions() []int {
	var vs []int
	for p := range f.Processes {
		vs = append(vs, p.Version)
	}
	for v, n := range f.CallsByVersion {
		if n > 0 {
			vs = append(vs, v)
		}
	}
	if f.Unversioned() > 0 {
		vs = append(vs, 4)
	}
	slices.Sort(vs)
	return slices.Compact(vs)
}

// Oldest is the oldest version in Versions, 0 when there is none.
func (f Fleet) Oldest() int {
	if vs := f.Versions(); len(vs) > 0 {
		return vs[0]
	}
	return 0
}

// ReadFleet reads which protocol versions the dependency's workers speak:
// the registered processes and the calls of the last whole minute by
// version, in one read-only script.
func (c *Client) ReadFleet(ctx context.Context) (Fleet, error) {
	res, err := versionsScript.Run(ctx, c.rdb, []string{c.keys.Clients, c.keys.Calls, c.keys.Stats}).Slice()
	if err != nil {
		return Fleet{}, fmt.Errorf("failed to read the fleet's versions of %s: %w", c.dep, err)
	}
	if len(res) != 5 {
		return Fleet{}, fmt.Errorf("unexpected versions reply %v", res)
	}
	nowMS, err1 := intAt(res, 0)
	from, err2 := intAt(res, 2)
	calls, err3 := intAt(res, 3)
	if err := errors.Join(err1, err2, err3); err != nil {
		return Fleet{}, err
	}
	f := Fleet{
		Processes:      map[Process]int{},
		From:           time.Unix(from, 0),
		Calls:          calls,
		CallsByVersion: map[int]int64{},
		Now:            time.UnixMilli(nowMS),
	}
	members, _ := res[1].([]any)
	for _, m := range members {
		s, _ := m.(string)
		client, rest, _ := strings.Cut(s, " ")
		version, _, ok := strings.Cut(rest, " ")
		v, err := strconv.Atoi(version)
		if !ok || err != nil {
			continue // not a member register.lua writes
		}
		f.Processes[Process{Client: client, Version: v}]++
	}
	kv, _ := res[4].([]any)
	for i := 0; i+1 < len(kv); i += 2 {
		s, _ := kv[i].(string)
		v, err := strconv.Atoi(s)
		if err != nil {
			continue
		}
		n, err := intAt(kv, i+1)
		if err != nil {
			return Fleet{}, err
		}
		f.CallsByVersion[v] += n
	}
	return f, nil
}

// Summary says which versions the fleet speaks, newest first, in a line:
// "v5: 3 go, 1 python; v4: 120 calls/min (unregistered)"; "none" when no
// worker registered or called in the last minute.
func (f Fleet) Summary() string {
	vs := f.Versions()
	if len(vs) == 0 {
		return "none"
	}
	var parts []string
	for i := len(vs) - 1; i >= 0; i-- {
		v := vs[i]
		var names []string
		for p := range f.Processes {
			if p.Version == v {
				names = append(names, p.Client)
			}
		}
		slices.Sort(names)
		clients := make([]string, len(names))
		for i, c := range names {
			clients[i] = fmt.Sprintf("%d %s", f.Processes[Process{Client: c, Version: v}], c)
		}
		part := "v" + strconv.Itoa(v) + ": "
		switch {
		case len(clients) > 0:
			part += strings.Join(clients, ", ")
		case v == 4 && f.CallsByVersion[4] == 0:
			part += fmt.Sprintf("%d calls/min (unregistered)", f.Unversioned())
		default:
			part += fmt.Sprintf("%d calls/min", f.CallsByVersion[v])
		}
		parts = append(parts, part)
	}
	return strings.Join(parts, "; ")
}

// Unserved lists the registered processes whose protocol version a manager
// of this version does not serve (Served), by client and version.
func (f Fleet) Unserved() map[Process]int {
	out := map[Process]int{}
	for p, n := range f.Processes {
		if !Served(p.Version) {
			out[p] = n
		}
	}
	return out
}
