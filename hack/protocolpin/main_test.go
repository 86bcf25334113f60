package main

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/spillway-dev/spillway/pkg/protocol"
)

// runMainEnv makes the test binary run main (TestMain), so that a test can
// run the command as `make verify` does and see its exit status and output.
const runMainEnv = "PROTOCOLPIN_TEST_RUN_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(runMainEnv) != "" {
		os.Args = append([]string{"protocolpin"}, strings.Fields(os.Getenv(runMainEnv))...)
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// repo is the repository's root.
var repo = filepath.Join("..", "..")

// scratchRoot copies what the check reads (pkg/protocol/lua, every pin,
// CHANGELOG.md) into a scratch root, and points git at the repository's
// history (GIT_DIR) so that the previous version's pin can be checked
// against the commit it names.
func scratchRoot(t *testing.T) string {
	t.Helper()
	gitDir, err := exec.Command("git", "-C", repo, "rev-parse", "--path-format=absolute", "--git-common-dir").Output()
	if err != nil {
		t.Fatalf("git rev-parse --git-common-dir (the check reads the previous version's commit from the history): %v", err)
	}
	t.Setenv("GIT_DIR", strings.TrimSpace(string(gitDir)))
	root := t.TempDir()
	var files []string
	for _, glob := range []string{"pkg/protocol/lua/*.lua", "pkg/protocol/pins/*.sum", "CHANGELOG.md"} {
		m, err := filepath.Glob(filepath.Join(repo, filepath.FromSlash(glob)))
		if err != nil || len(m) == 0 {
			t.Fatalf("%s: %v matches, %v", glob, m, err)
		}
		files = append(files, m...)
	}
	for _, src := range files {
		rel, err := filepath.Rel(repo, src)
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		dst := filepath.Join(root, rel)
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(dst, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

// edit rewrites the file rel under root with fn.
func edit(t *testing.T, root, rel string, fn func(string) string) {
	t.Helper()
	path := filepath.Join(root, filepath.FromSlash(rel))
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	after := fn(string(b))
	if after == string(b) {
		t.Fatalf("the edit left %s as it was", rel)
	}
	if err := os.WriteFile(path, []byte(after), 0o644); err != nil {
		t.Fatal(err)
	}
}

// wantErr checks that err is not nil and says every one of wants.
func wantErr(t *testing.T, err error, wants ...string) {
	t.Helper()
	if err == nil {
		t.Fatalf("the check passed, want it to fail saying %q", wants)
	}
	for _, w := range wants {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("%q\ndoes not say %q", err, w)
		}
	}
}

var (
	v       = protocol.Version
	curPin  = fmt.Sprintf("pkg/protocol/pins/v%d.sum", v)
	prevPin = fmt.Sprintf("pkg/protocol/pins/v%d.sum", v-1)
	// whatToDo is what the message of a changed wire says to do: a new
	// version, its pin, the previous version's commit, the CHANGELOG and
	// the skew test.
	whatToDo = []string{
		"A change to a script or a key is a new protocol version",
		"set protocol.Version to " + strconv.Itoa(v+1),
		"set \"commit\" to the last commit that shipped version " + strconv.Itoa(v),
		"go run ./hack/protocolpin -write",
		"## Protocol " + strconv.Itoa(v+1) + " (unreleased)",
		"make skew-long",
	}
)

// TestCheckPassesOnTheRepository: the committed wire matches its pins, as
// `make verify` requires, and so does the scratch copy the other tests
// change, so what fails them is their change alone.
func TestCheckPassesOnTheRepository(t *testing.T) {
	if err := check(repo); err != nil {
		t.Fatalf("check of the repository: %v", err)
	}
	if err := check(scratchRoot(t)); err != nil {
		t.Fatalf("check of an unchanged copy: %v", err)
	}
}

// TestCheckFailsOnAChangedScript: a Lua file changed, added or removed
// without a new protocol version fails the check, which names the file and
// says what to do.
func TestCheckFailsOnAChangedScript(t *testing.T) {
	for _, tt := range []struct {
		name   string
		change func(t *testing.T, root string)
		says   string
	}{
		{"changed", func(t *testing.T, root string) {
			edit(t, root, "pkg/protocol/lua/acquire.lua", func(s string) string { return s + "-- one more line\n" })
		}, "acquire.lua changed"},
		{"one byte changed", func(t *testing.T, root string) {
			edit(t, root, "pkg/protocol/lua/budget.lua", func(s string) string { return strings.Replace(s, "1000000", "1000001", 1) })
		}, "budget.lua changed"},
		{"added", func(t *testing.T, root string) {
			if err := os.WriteFile(filepath.Join(root, "pkg", "protocol", "lua", "drain.lua"), []byte("return 1\n"), 0o644); err != nil {
				t.Fatal(err)
			}
		}, "drain.lua was added"},
		{"removed", func(t *testing.T, root string) {
			if err := os.Remove(filepath.Join(root, "pkg", "protocol", "lua", "window.lua")); err != nil {
				t.Fatal(err)
			}
		}, "window.lua was removed"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			root := scratchRoot(t)
			tt.change(t, root)
			wantErr(t, check(root), append([]string{
				fmt.Sprintf("the wire of protocol version %d differs from its pin (%s)", v, filepath.Join(root, filepath.FromSlash(curPin))),
				tt.says,
			}, whatToDo...)...)
		})
	}
}

// TestCheckFailsOnAChangedKeyList: the key names come from the code
// (protocol.KeysFor and KeyPrefix); a key added, removed or renamed there
// without a new version leaves the pin's list behind it. The check fails
// naming both lists, and says what to do.
func TestCheckFailsOnAChangedKeyList(t *testing.T) {
	code := strings.Join(keyNames(), " ")
	if !strings.Contains(code, " released ") || !strings.Contains(code, "prefix="+protocol.KeyPrefix) {
		t.Fatalf("the code's keys %q lack 'released' or the prefix this test changes", code)
	}
	for _, tt := range []struct {
		name string
		pin  string // the pin's keys line, as it was before the code changed
	}{
		{"key added", strings.Replace(code, " released ", " ", 1)},
		{"key removed", code + " leftover"},
		{"key renamed", strings.Replace(code, " released ", " done ", 1)},
		{"prefix changed", strings.Replace(code, "prefix="+protocol.KeyPrefix, "prefix=spillway:v3:", 1)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			root := scratchRoot(t)
			edit(t, root, curPin, func(s string) string { return strings.Replace(s, "keys "+code+"\n", "keys "+tt.pin+"\n", 1) })
			wantErr(t, check(root), append([]string{
				fmt.Sprintf("the wire of protocol version %d differs from its pin", v),
				fmt.Sprintf("the keys changed from %v to %v", strings.Fields(tt.pin), keyNames()),
			}, whatToDo...)...)
		})
	}
}

// TestCheckFailsOnAPreviousPinThatIsNotItsCommit: the previous version's
// pin must name the commit whose Lua files it records (the skew test
// builds that commit as the old version): another commit, or none, fails.
func TestCheckFailsOnAPreviousPinThatIsNotItsCommit(t *testing.T) {
	prev, err := ReadPin(repo, v-1)
	if err != nil {
		t.Fatal(err)
	}
	older, err := ReadPin(repo, v-2)
	if err != nil {
		t.Fatal(err)
	}
	t.Run("another commit", func(t *testing.T) {
		root := scratchRoot(t)
		edit(t, root, prevPin, func(s string) string { return strings.Replace(s, "commit "+prev.Commit, "commit "+older.Commit, 1) })
		wantErr(t, check(root), fmt.Sprintf("does not match the Lua files of commit %s", older.Commit),
			fmt.Sprintf("it must name the commit that last shipped protocol version %d", v-1))
	})
	t.Run("no commit", func(t *testing.T) {
		root := scratchRoot(t)
		edit(t, root, prevPin, func(s string) string { return strings.Replace(s, "commit "+prev.Commit, "commit -", 1) })
		wantErr(t, check(root), "names no commit", fmt.Sprintf("the last commit that shipped protocol version %d", v-1))
	})
}

// TestCommandExitsNonZeroWithItsMessage: run as `make verify` runs it, the
// command exits 1 and prints the check's message on a changed script, and
// exits 0 on an unchanged tree.
func TestCommandExitsNonZeroWithItsMessage(t *testing.T) {
	run := func(root string) (int, string) {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), runMainEnv+"=-root "+root)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		err := cmd.Run()
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			return exit.ExitCode(), stderr.String()
		}
		if err != nil {
			t.Fatal(err)
		}
		return 0, stderr.String()
	}
	root := scratchRoot(t)
	if code, out := run(root); code != 0 {
		t.Fatalf("unchanged tree: exit %d, %s", code, out)
	}
	edit(t, root, "pkg/protocol/lua/release.lua", func(s string) string { return strings.Replace(s, "local", "local ", 1) })
	code, out := run(root)
	if code != 1 || !strings.HasPrefix(out, fmt.Sprintf("protocolpin: the wire of protocol version %d differs from its pin", v)) || !strings.Contains(out, "release.lua changed") {
		t.Errorf("changed release.lua: exit %d, stderr %q; want 1 and the check's message", code, out)
	}
}

// TestWriteOnlyWhileUnreleased: -write records the current version's pin
// while CHANGELOG.md lists it as unreleased, after which the check passes;
// once released, it refuses and says to make a new version.
func TestWriteOnlyWhileUnreleased(t *testing.T) {
	heading := fmt.Sprintf("## Protocol %d (unreleased)", v)
	root := scratchRoot(t)
	edit(t, root, "pkg/protocol/lua/pool.lua", func(s string) string { return s + "-- changed\n" })
	changelog := filepath.Join(root, "CHANGELOG.md")
	if b, err := os.ReadFile(changelog); err != nil {
		t.Fatal(err)
	} else if err := os.WriteFile(changelog, bytes.Replace(b, []byte(heading), fmt.Appendf(nil, "## Protocol %d (released 2026-12-08)", v), 1), 0o644); err != nil {
		t.Fatal(err)
	}
	wantErr(t, writePin(root), fmt.Sprintf("CHANGELOG.md has no %q", heading), "change it as a new version")
	wantErr(t, check(root), "pool.lua changed")

	root = scratchRoot(t)
	if b, err := os.ReadFile(filepath.Join(root, "CHANGELOG.md")); err != nil || !bytes.Contains(b, []byte(heading)) {
		t.Skipf("version %d is released (CHANGELOG.md has no %q): -write cannot record its pin", v, heading)
	}
	edit(t, root, "pkg/protocol/lua/pool.lua", func(s string) string { return s + "-- changed\n" })
	wantErr(t, check(root), "pool.lua changed")
	if err := writePin(root); err != nil {
		t.Fatalf("-write while unreleased: %v", err)
	}
	if err := check(root); err != nil {
		t.Errorf("check after -write: %v", err)
	}
}
