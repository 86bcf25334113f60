// Package skewtest is what the version-skew tests share (test/skew, the
// rolling upgrade under load; test/helm, the chart upgrade with workers
// calling): the code of an older commit, taken from the repository's own
// history and built (the last commit of the previous protocol version,
// which its pin names: PinFile); the worker
// programs (worker/main.go, built against either tree, and worker/worker.py,
// run on either tree's clients/python); a fake dependency that counts the
// calls in flight across every process; and manager processes.
//
// Old trees and their binaries are cached under $SPILLWAY_CACHE (else
// ~/.cache/spillway) in oldversion/<commit>, so only a test's first run
// builds them.
package skewtest

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/testenv"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// PinFile is the pin of the protocol version before this tree's
// (hack/protocolpin, which `make verify` runs), relative to the
// repository's root: its "commit" line names the last commit that shipped
// that version, the old version the skew tests build.
func PinFile() string {
	return filepath.Join("pkg", "protocol", "pins", fmt.Sprintf("v%d.sum", protocol.Version-1))
}

// Pinned is the commit PinFile names.
func Pinned() (string, error) {
	path := filepath.Join(testenv.RepoRoot(), PinFile())
	f, err := os.Open(path)
	if err != nil {
		return "", fmt.Errorf("failed to read the previous protocol version's pin: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		c, ok := strings.CutPrefix(strings.TrimSpace(sc.Text()), "commit ")
		if !ok {
			continue
		}
		c = strings.TrimSpace(c)
		if len(c) != 40 || strings.Trim(c, "0123456789abcdef") != "" {
			return "", fmt.Errorf("%s: commit %q is not a full commit hash", PinFile(), c)
		}
		return c, nil
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("failed to read %s: %w", PinFile(), err)
	}
	return "", fmt.Errorf("%s names no commit", PinFile())
}

// PreviousScript is the protocol script name of the version before this
// tree's, as the commit Pinned names shipped it, lib.lua prepended as that
// version's clients ran it: the real old code, read from the repository's
// history (a shallow clone lacks it).
func PreviousScript(name string) (*redis.Script, error) {
	commit, err := Pinned()
	if err != nil {
		return nil, err
	}
	var body strings.Builder
	for _, n := range []string{"lib", name} {
		out, err := git(testenv.RepoRoot(), "show", commit+":pkg/protocol/lua/"+n+".lua")
		if err != nil {
			return nil, fmt.Errorf("failed to read the previous protocol version's %s.lua from the repository's history (a shallow clone lacks it): %w", n, err)
		}
		body.WriteString(out)
	}
	return redis.NewScript(body.String()), nil
}

// CacheDir is $SPILLWAY_CACHE, else ~/.cache/spillway, as in the Makefile.
func CacheDir() string {
	if dir := os.Getenv("SPILLWAY_CACHE"); dir != "" {
		return dir
	}
	base, err := os.UserCacheDir()
	if err != nil {
		base = os.TempDir()
	}
	return filepath.Join(base, "spillway")
}

// Tree is the source tree of commit, extracted from this repository's
// history with git archive into the cache on first use.
func Tree(commit string) (string, error) {
	dir := filepath.Join(CacheDir(), "oldversion", commit)
	tree := filepath.Join(dir, "tree")
	if _, err := os.Stat(filepath.Join(tree, "go.mod")); err == nil {
		return tree, nil
	}
	root := testenv.RepoRoot()
	if _, err := git(root, "cat-file", "-e", commit+"^{commit}"); err != nil {
		why := ""
		if out, err := git(root, "rev-parse", "--is-shallow-repository"); err == nil && strings.TrimSpace(out) == "true" {
			why = " (this clone is shallow)"
		}
		return "", fmt.Errorf("the commit %s (%s: the last commit of protocol version %d) is not in this clone%s: "+
			"the skew tests build the old version from the repository's history; fetch it with 'git fetch --unshallow' "+
			"(CI clones fully): %w", commit, PinFile(), protocol.Version-1, why, err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	tmp, err := os.MkdirTemp(dir, "tree-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp) // gone once renamed
	archive := exec.Command("git", "-C", root, "archive", "--format=tar", commit)
	extract := exec.Command("tar", "-x", "-C", tmp)
	pipe, err := archive.StdoutPipe()
	if err != nil {
		return "", err
	}
	extract.Stdin = pipe
	var archiveErr, extractErr bytes.Buffer
	archive.Stderr, extract.Stderr = &archiveErr, &extractErr
	if err := extract.Start(); err != nil {
		return "", fmt.Errorf("failed to start tar: %w", err)
	}
	if err := archive.Run(); err != nil {
		_ = extract.Wait()
		return "", fmt.Errorf("git archive %s: %w: %s", commit, err, archiveErr.String())
	}
	if err := extract.Wait(); err != nil {
		return "", fmt.Errorf("failed to extract the tree of %s: %w: %s", commit, err, extractErr.String())
	}
	if err := os.Rename(tmp, tree); err != nil {
		// Another test process extracted it first.
		if _, statErr := os.Stat(filepath.Join(tree, "go.mod")); statErr == nil {
			return tree, nil
		}
		return "", fmt.Errorf("failed to move the tree of %s into the cache: %w", commit, err)
	}
	return tree, nil
}

// git runs git in dir and returns its standard output.
func git(dir string, args ...string) (string, error) {
	cmd := exec.Command("git", append([]string{"-C", dir}, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("git %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return string(out), nil
}

// WorkerSource is the Go worker program, built against either tree.
func WorkerSource() string {
	return filepath.Join(testenv.RepoRoot(), "internal", "skewtest", "worker", "main.go")
}

// WorkerScript is the Python worker program, run on either tree's
// clients/python.
func WorkerScript() string {
	return filepath.Join(testenv.RepoRoot(), "internal", "skewtest", "worker", "worker.py")
}

// Binaries are the programs of one version: its manager and its Go worker,
// and the directory of its Python client (for PYTHONPATH).
type Binaries struct {
	// Version names the version in logs and messages: "old" or "new".
	Version string
	Manager string
	Worker  string
	Python  string
	// Chart is the version's charts/spillway.
	Chart string
}

// Old builds, or finds in the cache, the programs of commit: its
// ./cmd/manager and the worker program linked against its tree. The
// binaries are keyed by the Go version and, for the worker, by its source.
func Old(commit string) (Binaries, error) {
	tree, err := Tree(commit)
	if err != nil {
		return Binaries{}, err
	}
	goVersion, err := goVersion()
	if err != nil {
		return Binaries{}, err
	}
	src, err := os.ReadFile(WorkerSource())
	if err != nil {
		return Binaries{}, err
	}
	bin := filepath.Join(CacheDir(), "oldversion", commit, "bin")
	b := Binaries{
		Version: "old",
		Manager: filepath.Join(bin, "manager-"+key(goVersion)),
		Worker:  filepath.Join(bin, "worker-"+key(goVersion, string(src))),
		Python:  filepath.Join(tree, "clients", "python"),
		Chart:   filepath.Join(tree, "charts", "spillway"),
	}
	var wg sync.WaitGroup
	var errs [2]error
	wg.Go(func() { errs[0] = buildCached(tree, "./cmd/manager", b.Manager) })
	wg.Go(func() { errs[1] = buildCached(tree, WorkerSource(), b.Worker) })
	wg.Wait()
	return b, errors.Join(errs[:]...)
}

// New builds the programs of this tree into dir (the Go build cache makes
// a rebuild of an unchanged tree quick).
func New(dir string) (Binaries, error) {
	root := testenv.RepoRoot()
	b := Binaries{
		Version: "new",
		Manager: filepath.Join(dir, "manager-new"),
		Worker:  filepath.Join(dir, "worker-new"),
		Python:  filepath.Join(root, "clients", "python"),
		Chart:   filepath.Join(root, "charts", "spillway"),
	}
	var wg sync.WaitGroup
	var errs [2]error
	wg.Go(func() { errs[0] = build(root, "./cmd/manager", b.Manager) })
	wg.Go(func() { errs[1] = build(root, WorkerSource(), b.Worker) })
	wg.Wait()
	return b, errors.Join(errs[:]...)
}

// buildCached builds target in dir into out unless out exists.
func buildCached(dir, target, out string) error {
	if _, err := os.Stat(out); err == nil {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return err
	}
	tmp := fmt.Sprintf("%s.%d.tmp", out, os.Getpid())
	defer os.Remove(tmp)
	if err := build(dir, target, tmp); err != nil {
		return err
	}
	return os.Rename(tmp, out)
}

// build runs go build -o out target in dir: target is a package of dir's
// module or a file, whose imports dir's module resolves.
func build(dir, target, out string) error {
	cmd := exec.Command("go", "build", "-o", out, target)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOWORK=off")
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("failed to build %s in %s: %w\n%s", target, dir, err, b)
	}
	return nil
}

var goVersion = sync.OnceValues(func() (string, error) {
	out, err := exec.Command("go", "env", "GOVERSION").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOVERSION: %w", err)
	}
	return strings.TrimSpace(string(out)), nil
})

// key is a short hash of parts.
func key(parts ...string) string {
	h := sha256.New()
	for _, p := range parts {
		fmt.Fprintf(h, "%d:%s", len(p), p)
	}
	return hex.EncodeToString(h.Sum(nil))[:16]
}
