// Package outside compiles what a user of Spillway copies, the Go blocks of
// the README and the package examples (example_test.go) of pkg/, as a module
// outside this one, the way a service or a worker meets the public API. Test
// files inside this module may import internal packages and use unexported
// helpers; a user's module may not ("use of internal package ... not
// allowed"), so only an outside build shows that every option the docs
// describe can be set.
//
// The check is a test here, beside the end-to-end tests, because it belongs
// to no package of the module: it builds a throw-away module that requires
// this one through a replace directive to the working tree and reuses its
// go.sum, then runs one go vet over all the snippets (a build plus vet's
// checks). Offline it needs the module cache that building this repository
// filled; on a fresh machine the go command fetches through GOPROXY.
package outside_test

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

const modulePath = "github.com/spillway-dev/spillway"

// block is one fenced Go code block of a Markdown file.
type block struct {
	line int // of the opening fence, from 1
	src  string
}

// goBlocks returns the ```go blocks of a Markdown document. A fence may be
// indented and carry more words after the language ("```go title"); an
// unterminated Go block is an error, since it would silently go unchecked.
func goBlocks(md []byte) ([]block, error) {
	var (
		out   []block
		cur   *block
		fence string
		buf   strings.Builder
	)
	sc := bufio.NewScanner(bytes.NewReader(md))
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		trimmed := strings.TrimSpace(line)
		if cur == nil {
			if !strings.HasPrefix(trimmed, "```") && !strings.HasPrefix(trimmed, "~~~") {
				continue
			}
			rest := strings.TrimLeft(trimmed, trimmed[:1])
			fence = trimmed[:len(trimmed)-len(rest)] // the whole run: ```` may enclose ```
			info := strings.Fields(rest)
			if len(info) > 0 && info[0] == "go" {
				cur = &block{line: n}
				buf.Reset()
			} else {
				cur = &block{line: -n} // a block in another language: skip to its end
			}
			continue
		}
		if strings.HasPrefix(trimmed, fence) && strings.Trim(trimmed, fence[:1]) == "" { // a run at least as long closes
			if cur.line > 0 {
				cur.src = buf.String()
				out = append(out, *cur)
			}
			cur = nil
			continue
		}
		if cur.line > 0 {
			buf.WriteString(line)
			buf.WriteByte('\n')
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if cur != nil && cur.line > 0 {
		return nil, fmt.Errorf("line %d: the Go block is never closed", cur.line)
	}
	return out, nil
}

var packageClause = regexp.MustCompile(`(?m)^package [A-Za-z_][A-Za-z0-9_]*[ \t]*$`)

// asFile returns src as a Go file of package pkg, or an error if src is not a
// complete file (a package clause, imports and declarations): a fragment
// cannot be compiled as it stands, so a reader could not paste it either.
func asFile(src, pkg string) (string, error) {
	loc := packageClause.FindStringIndex(src)
	if loc == nil {
		return "", errors.New("not a complete Go file: write it with its package clause and imports, so that it compiles as it stands")
	}
	if pkg == "main" || strings.TrimSpace(src[loc[0]:loc[1]]) == "package main" {
		return src, nil
	}
	return src[:loc[0]] + "package " + pkg + src[loc[1]:], nil
}

// snippet is one file to compile outside: where it came from and its text.
type snippet struct {
	from string // for messages: README.md:99, pkg/shed/example_test.go
	dir  string // its package directory in the outside module
	src  string
}

// collect returns the README's Go blocks and the example files of every
// package outside internal/ directories (an internal package's examples may
// import internal packages legitimately).
func collect(root string) ([]snippet, error) {
	var out []snippet
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		return nil, err
	}
	blocks, err := goBlocks(readme)
	if err != nil {
		return nil, fmt.Errorf("README.md: %w", err)
	}
	for i, b := range blocks {
		dir := fmt.Sprintf("readme%d", i+1)
		src, err := asFile(b.src, dir)
		if err != nil {
			return nil, fmt.Errorf("README.md:%d: %w", b.line, err)
		}
		out = append(out, snippet{from: fmt.Sprintf("README.md:%d", b.line), dir: dir, src: src})
	}
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			name := d.Name()
			if rel != "." && (strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") || name == "testdata" || name == "internal" || name == "vendor") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasPrefix(d.Name(), "example") || !strings.HasSuffix(d.Name(), "_test.go") {
			return nil
		}
		body, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		dir := "examples_" + strings.NewReplacer("/", "_", ".", "_", "-", "_").Replace(filepath.ToSlash(rel))
		dir = strings.TrimSuffix(dir, "_go")
		src, err := asFile(string(body), dir)
		if err != nil {
			return fmt.Errorf("%s: %w", rel, err)
		}
		out = append(out, snippet{from: filepath.ToSlash(rel), dir: dir, src: src})
		return nil
	})
	return out, err
}

// outsideModule writes a module in a new temporary directory that requires
// this one (replaced by the working tree at root) and holds each snippet in
// a package of its own, and returns the directory.
func outsideModule(t *testing.T, root string, snippets []snippet) string {
	t.Helper()
	dir := t.TempDir()
	goVersion, err := goDirective(filepath.Join(root, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	mod := fmt.Sprintf("module example.com/outside\n\ngo %s\n\nrequire %s v0.0.0-00010101000000-000000000000\n\nreplace %s => %s\n",
		goVersion, modulePath, modulePath, filepath.ToSlash(root))
	write(t, filepath.Join(dir, "go.mod"), mod)
	sum, err := os.ReadFile(filepath.Join(root, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	write(t, filepath.Join(dir, "go.sum"), string(sum))
	for _, s := range snippets {
		write(t, filepath.Join(dir, s.dir, "snippet.go"), s.src)
	}
	return dir
}

// goDirective reads the go version of a go.mod.
func goDirective(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	m := regexp.MustCompile(`(?m)^go (\S+)$`).FindSubmatch(b)
	if m == nil {
		return "", fmt.Errorf("%s has no go directive", path)
	}
	return string(m[1]), nil
}

func write(t *testing.T, path, body string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
}

// goCmd runs the go command in the outside module. -mod=mod lets it add the
// requirements the snippets import (at the versions this module selects) to
// the throw-away go.mod; GOWORK=off keeps a workspace from replacing the
// outside view.
func goCmd(dir string, args ...string) ([]byte, error) {
	cmd := exec.Command("go", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod", "GOWORK=off")
	return cmd.CombinedOutput()
}

func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(root, "go.mod")); err != nil || !bytes.Contains(b, []byte("module "+modulePath+"\n")) {
		t.Fatalf("%s is not the root of %s: %v", root, modulePath, err)
	}
	return root
}

// TestSnippetsCompileOutsideTheModule builds the README's Go blocks and the
// package examples as another module would, and shows in the same module
// that such a build refuses an internal import.
func TestSnippetsCompileOutsideTheModule(t *testing.T) {
	if _, err := exec.LookPath("go"); err != nil {
		t.Fatalf("the go command is needed to build outside the module: %v", err)
	}
	root := repoRoot(t)
	snippets, err := collect(root)
	if err != nil {
		t.Fatal(err)
	}
	var from []string
	for _, s := range snippets {
		from = append(from, s.from)
	}
	t.Logf("compiling outside the module: %s", strings.Join(from, ", "))
	// The README's worker example and the examples of pkg/shed and pkg/retry
	// at least: finding none would mean the collection broke, not that all is
	// well.
	for _, want := range []string{"README.md:", "pkg/shed/example_test.go", "pkg/retry/example_test.go"} {
		if !slices.ContainsFunc(from, func(f string) bool { return strings.HasPrefix(f, want) }) {
			t.Fatalf("no snippet from %s among %v", want, from)
		}
	}

	// A canary that imports an internal package, as a user might copy from a
	// test of this module. It is built on its own: go vet ./snippets/... must
	// not see it.
	canary := snippet{from: "canary", dir: "canary", src: `package canary

import "github.com/spillway-dev/spillway/internal/ramp"

var _ = ramp.Schedule{}
`}
	for i := range snippets {
		snippets[i].dir = filepath.Join("snippets", snippets[i].dir)
	}
	dir := outsideModule(t, root, append(snippets, canary))

	if out, err := goCmd(dir, "vet", "./snippets/..."); err != nil {
		t.Fatalf("the README's Go blocks or the package examples do not compile outside the module (packages are named after their source: readmeN is the README's Nth Go block):\n%s", out)
	}

	t.Run("an internal import is refused", func(t *testing.T) {
		out, err := goCmd(dir, "vet", "./canary")
		if err == nil {
			t.Fatalf("go vet ./canary succeeded: the outside build would not catch a snippet that imports an internal package\n%s", out)
		}
		if !bytes.Contains(out, []byte("use of internal package "+modulePath+"/internal/ramp not allowed")) {
			t.Fatalf("go vet ./canary failed for another reason than the internal import:\n%s", out)
		}
	})
}

func TestGoBlocks(t *testing.T) {
	md := "# Title\n\n```sh\nmake test\n```\n\n```go\npackage a\n```\n\n  ```go title\n  package b\n  ```\n\n~~~go\npackage c\n~~~\n\n````go\n```\npackage d\n````\n"
	got, err := goBlocks([]byte(md))
	if err != nil {
		t.Fatal(err)
	}
	want := []block{
		{line: 7, src: "package a\n"},
		{line: 11, src: "  package b\n"},
		{line: 15, src: "package c\n"},
		{line: 19, src: "```\npackage d\n"},
	}
	if !slices.Equal(got, want) {
		t.Fatalf("goBlocks() = %+v, want %+v", got, want)
	}
	if _, err := goBlocks([]byte("```go\npackage a\n")); err == nil || !strings.Contains(err.Error(), "line 1") {
		t.Fatalf("goBlocks(unterminated) error = %v, want one naming line 1", err)
	}
}

func TestAsFile(t *testing.T) {
	for _, tc := range []struct {
		src, pkg, want, wantErr string
	}{
		{src: "// Doc.\npackage shed_test\n\nfunc Example() {}\n", pkg: "examples_x", want: "// Doc.\npackage examples_x\n\nfunc Example() {}\n"},
		{src: "package main\n\nfunc main() {}\n", pkg: "readme1", want: "package main\n\nfunc main() {}\n"},
		{src: "g, err := guard.New(rdb, \"a/b\", guard.Options{})\n", pkg: "readme1", wantErr: "not a complete Go file"},
		{src: "// package comment only\nfunc f() {}\n", pkg: "readme1", wantErr: "not a complete Go file"},
	} {
		got, err := asFile(tc.src, tc.pkg)
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("asFile(%q) error = %v, want %q", tc.src, err, tc.wantErr)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("asFile(%q) = %q, %v, want %q", tc.src, got, err, tc.want)
		}
	}
}
