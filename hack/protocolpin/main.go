// Command protocolpin pins each protocol version's wire: the SHA-256 of every
// Lua file in pkg/protocol/lua and the names of the keys (protocol.Keys), in
// pkg/protocol/pins/v<N>.sum. `make verify` runs it to check that
//
//   - the scripts and keys of the current version (protocol.Version) are the
//     ones its pin records: a change to the wire is a new protocol version;
//   - the previous version's pin names the commit that last shipped it, and
//     that commit's Lua files are the ones the pin records: the version-skew
//     test (test/skew) builds that commit as the old version, so the skew it
//     tests is the one workers and managers will meet.
//
// While the current version is unreleased (CHANGELOG.md's heading for it says
// "unreleased"), -write records its pin anew.
//
//	go run ./hack/protocolpin [-root DIR] [-write]
package main

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"

	"github.com/spillway-dev/spillway/pkg/protocol"
)

func main() {
	root := flag.String("root", ".", "Root of the repository.")
	write := flag.Bool("write", false, "Record the current version's pin (only while CHANGELOG.md lists it as unreleased).")
	flag.Parse()
	var err error
	if *write {
		err = writePin(*root)
	} else {
		err = check(*root)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "protocolpin:", err)
		os.Exit(1)
	}
}

// Pin is one version's record: the commit that last shipped it ("-" while it
// is the current version), its Lua files' SHA-256 and its key names.
type Pin struct {
	Version int
	Commit  string
	Lua     map[string]string
	Keys    []string
}

// PinPath is where version v's pin lives under root.
func PinPath(root string, v int) string {
	return filepath.Join(root, "pkg", "protocol", "pins", fmt.Sprintf("v%d.sum", v))
}

// current is the pin of the working tree's wire.
func current(root string) (Pin, error) {
	files, err := filepath.Glob(filepath.Join(root, "pkg", "protocol", "lua", "*.lua"))
	if err != nil {
		return Pin{}, err
	}
	p := Pin{Version: protocol.Version, Commit: "-", Lua: map[string]string{}, Keys: keyNames()}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return Pin{}, err
		}
		p.Lua[filepath.Base(f)] = sum(b)
	}
	return p, nil
}

// keyNames are the names of a dependency's keys after its prefix, and the
// prefix itself: a key renamed, added or removed changes them.
func keyNames() []string {
	d := protocol.Dependency{Namespace: "ns", Name: "name"}
	k := protocol.KeysFor(d)
	prefix := protocol.KeyPrefix + "{ns/name}:"
	names := []string{"prefix=" + protocol.KeyPrefix, strings.TrimPrefix(k.Job("<key>"), prefix)}
	v := reflect.ValueOf(k)
	for i := range v.NumField() {
		if f := v.Field(i); v.Type().Field(i).IsExported() && f.Kind() == reflect.String {
			names = append(names, strings.TrimPrefix(f.String(), prefix))
		}
	}
	slices.Sort(names)
	return names
}

func sum(b []byte) string {
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

// format writes p as its .sum file.
func format(p Pin) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "# Protocol version %d: the SHA-256 of every Lua file of pkg/protocol/lua and the key\n", p.Version)
	fmt.Fprintf(&b, "# names (hack/protocolpin). commit is the last commit that shipped this version, \"-\"\n")
	fmt.Fprintf(&b, "# while it is the current one.\n")
	fmt.Fprintf(&b, "version %d\ncommit %s\n", p.Version, p.Commit)
	names := make([]string, 0, len(p.Lua))
	for n := range p.Lua {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		fmt.Fprintf(&b, "lua %s %s\n", n, p.Lua[n])
	}
	fmt.Fprintf(&b, "keys %s\n", strings.Join(p.Keys, " "))
	return b.Bytes()
}

// ReadPin reads version v's pin under root.
func ReadPin(root string, v int) (Pin, error) {
	b, err := os.ReadFile(PinPath(root, v))
	if err != nil {
		return Pin{}, err
	}
	p := Pin{Lua: map[string]string{}}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 || strings.HasPrefix(f[0], "#") {
			continue
		}
		switch {
		case f[0] == "version" && len(f) == 2:
			_, err = fmt.Sscanf(f[1], "%d", &p.Version)
		case f[0] == "commit" && len(f) == 2:
			p.Commit = f[1]
		case f[0] == "lua" && len(f) == 3:
			p.Lua[f[1]] = f[2]
		case f[0] == "keys":
			p.Keys = f[1:]
		default:
			err = fmt.Errorf("%s: cannot read line %q", PinPath(root, v), sc.Text())
		}
		if err != nil {
			return Pin{}, err
		}
	}
	return p, sc.Err()
}

// diff says how got differs from want, file by file; empty when equal.
func diff(want, got Pin) []string {
	var out []string
	for n, s := range want.Lua {
		switch g, ok := got.Lua[n]; {
		case !ok:
			out = append(out, n+" was removed")
		case g != s:
			out = append(out, n+" changed")
		}
	}
	for n := range got.Lua {
		if _, ok := want.Lua[n]; !ok {
			out = append(out, n+" was added")
		}
	}
	if !slices.Equal(want.Keys, got.Keys) {
		out = append(out, fmt.Sprintf("the keys changed from %v to %v", want.Keys, got.Keys))
	}
	slices.Sort(out)
	return out
}

// check is `make verify`'s check.
func check(root string) error {
	v := protocol.Version
	cur, err := current(root)
	if err != nil {
		return err
	}
	pin, err := ReadPin(root, v)
	if errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("protocol version %d has no pin (%s): a new version records its wire with `go run ./hack/protocolpin -write` (docs/protocol.md §10)", v, PinPath(root, v))
	}
	if err != nil {
		return err
	}
	if d := diff(pin, cur); len(d) > 0 {
		return fmt.Errorf(`the wire of protocol version %d differs from its pin (%s): %s.
A change to a script or a key is a new protocol version (docs/protocol.md §10); workers and managers of
the previous version must keep working beside it. Either put version %d's scripts and keys back, or:
  1. set protocol.Version to %d (and VERSION in clients/python/spillway/protocol.py and the Node client),
     with the state versions it acts on (docs/protocol.md §10);
  2. in %s, set "commit" to the last commit that shipped version %d: the version-skew test (test/skew)
     builds that commit as the old version;
  3. run `+"`go run ./hack/protocolpin -write`"+` to pin version %d, and add "## Protocol %d (unreleased)" to CHANGELOG.md
     saying what changed for operators;
  4. run the version-skew test: make test runs its short form, make skew-long the long one.
If version %d was never released (CHANGELOG.md says "unreleased"), `+"`go run ./hack/protocolpin -write`"+` updates its pin`,
			v, PinPath(root, v), strings.Join(d, ", "), v, v+1, PinPath(root, v), v, v+1, v+1, v)
	}
	return checkPrevious(root, v-1)
}

// checkPrevious checks version v's pin against the commit it names: that
// commit's Lua files must be the pinned ones, so that the skew test, which
// builds it, runs version v.
func checkPrevious(root string, v int) error {
	pin, err := ReadPin(root, v)
	if errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("the previous protocol version %d has no pin (%s): record the commit that last shipped it and its Lua files' sums there", v, PinPath(root, v))
	}
	if err != nil {
		return err
	}
	if pin.Commit == "" || pin.Commit == "-" {
		return fmt.Errorf("%s names no commit: set \"commit\" to the last commit that shipped protocol version %d, which the version-skew test builds", PinPath(root, v), v)
	}
	old := Pin{Version: v, Commit: pin.Commit, Lua: map[string]string{}, Keys: pin.Keys}
	out, err := exec.Command("git", "-C", root, "ls-tree", "--name-only", pin.Commit, "pkg/protocol/lua/").Output()
	if err != nil {
		return fmt.Errorf("cannot list pkg/protocol/lua at %s, the commit %s names (a shallow clone? fetch the history): %w", pin.Commit, PinPath(root, v), err)
	}
	for _, f := range strings.Fields(string(out)) {
		if !strings.HasSuffix(f, ".lua") {
			continue
		}
		b, err := exec.Command("git", "-C", root, "show", pin.Commit+":"+f).Output()
		if err != nil {
			return fmt.Errorf("cannot read %s at %s: %w", f, pin.Commit, err)
		}
		old.Lua[filepath.Base(f)] = sum(b)
	}
	if d := diff(pin, old); len(d) > 0 {
		return fmt.Errorf("%s does not match the Lua files of commit %s, which it names: %s; it must name the commit that last shipped protocol version %d", PinPath(root, v), pin.Commit, strings.Join(d, ", "), v)
	}
	return nil
}

// writePin records the current version's pin, while CHANGELOG.md lists it as
// unreleased.
func writePin(root string) error {
	v := protocol.Version
	log, err := os.ReadFile(filepath.Join(root, "CHANGELOG.md"))
	if err != nil {
		return err
	}
	heading := fmt.Sprintf("## Protocol %d (unreleased)", v)
	if !bytes.Contains(log, []byte(heading)) {
		return fmt.Errorf("CHANGELOG.md has no %q: a released version's wire is fixed; change it as a new version (run this command without -write for the steps)", heading)
	}
	cur, err := current(root)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(PinPath(root, v)), 0o755); err != nil {
		return err
	}
	return os.WriteFile(PinPath(root, v), format(cur), 0o644)
}
