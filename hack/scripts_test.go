// Package hack holds the setup scripts the Makefile runs; its tests check
// that they stay quiet on a machine that has everything and show a failing
// step's output in full.
package hack

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// script runs a script or command with extra environment variables and
// returns its exit code, stdout and stderr.
func script(t *testing.T, env []string, name string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Env = append(os.Environ(), env...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	if exit, ok := err.(*exec.ExitError); ok {
		code = exit.ExitCode()
	} else if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return code, out.String(), errOut.String()
}

func executable(t *testing.T, path string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte("#!/bin/sh\nexit 0\n"), 0o755); err != nil {
		t.Fatal(err)
	}
}

// cachedMachine is a cache holding both envtest binaries, a PATH with
// redis-server, redis-cli, redis-sentinel and prometheus, and a python3
// (SPILLWAY_PYTHON) that imports every module the Python client's tests need:
// what a machine has after its first run. The binaries are stand-ins; the
// scripts only look for them.
func cachedMachine(t *testing.T) (env []string, dest string) {
	t.Helper()
	cache := t.TempDir()
	dest = filepath.Join(cache, "envtest", "1.37.2")
	executable(t, filepath.Join(dest, "kube-apiserver"))
	executable(t, filepath.Join(dest, "etcd"))
	bin := t.TempDir()
	for _, name := range []string{"redis-server", "redis-cli", "redis-sentinel", "prometheus"} {
		executable(t, filepath.Join(bin, name))
	}
	python := fakePython(t, t.TempDir(), "redis", "celery", "pytest", "prometheus_client",
		"requests", "urllib3", "httpx", "grpc")
	return []string{
		"SPILLWAY_CACHE=" + cache, "K8S_VERSION=1.37.2", "SPILLWAY_VERBOSE=", "PROMETHEUS=",
		"SPILLWAY_PYTHON=" + python,
		"PATH=" + bin + string(os.PathListSeparator) + os.Getenv("PATH"),
	}, dest
}

// fakePython writes dir/python3, a stand-in for `python3 -c "import a,b"`
// that succeeds when dir/modules holds a file for every module named, and
// creates one for each of modules. The fake apt-get of fakeAptForPython
// installs a module by creating its file.
func fakePython(t *testing.T, dir string, modules ...string) string {
	t.Helper()
	for _, module := range modules {
		executable(t, filepath.Join(dir, "modules", module, "installed"))
	}
	python := filepath.Join(dir, "python3")
	body := `#!/bin/sh
[ "$1" = -c ] || exit 2
for module in $(echo "${2#import }" | tr , ' '); do
  [ -e "$(dirname "$0")/modules/${module}/installed" ] || { echo "ModuleNotFoundError: No module named '${module}'" >&2; exit 1; }
done
`
	if err := os.WriteFile(python, []byte(body), 0o755); err != nil {
		t.Fatal(err)
	}
	return python
}

func TestSetupScriptsAreSilentOnACachedMachine(t *testing.T) {
	env, dest := cachedMachine(t)
	code, out, errOut := script(t, env, "./setup-envtest.sh")
	if code != 0 || out != dest+"\n" || errOut != "" {
		t.Errorf("setup-envtest.sh: exit %d, stdout %q (want %q), stderr %q (want nothing)", code, out, dest+"\n", errOut)
	}
	for _, name := range []string{"./setup-redis.sh", "./setup-prometheus.sh", "./setup-python.sh"} {
		code, out, errOut = script(t, env, name)
		if code != 0 || out != "" || errOut != "" {
			t.Errorf("%s: exit %d, stdout %q, stderr %q; want nothing", name, code, out, errOut)
		}
	}
}

// TestMakeSetupTargetsAreSilentOnACachedMachine checks the Makefile does not
// echo the setup commands either: a second `make test` starts with the tests.
func TestMakeSetupTargetsAreSilentOnACachedMachine(t *testing.T) {
	if _, err := exec.LookPath("make"); err != nil {
		t.Skip("make is not installed")
	}
	env, _ := cachedMachine(t)
	code, out, errOut := script(t, env, "make", "-C", "..", "--no-print-directory", "envtest", "redis", "modules", "prometheus")
	if code != 0 || out != "" || errOut != "" {
		t.Errorf("make envtest redis modules prometheus: exit %d, stdout %q, stderr %q; want nothing", code, out, errOut)
	}
}

func TestStepPrintsOneLineAndHidesTheOutput(t *testing.T) {
	code, out, errOut := script(t, nil, "./step.sh", "saying hello", "sh", "-c", "echo go: added a v1; echo go: added b v2 >&2")
	if code != 0 || out != "" {
		t.Fatalf("exit %d, stdout %q", code, out)
	}
	if !regexp.MustCompile(`^saying hello\.\.\. done in \d+s\n$`).MatchString(errOut) {
		t.Errorf("stderr %q, want one line 'saying hello... done in Ns'", errOut)
	}
}

func TestStepShowsAFailingStepsOutputInFull(t *testing.T) {
	code, out, errOut := script(t, nil, "./step.sh", "building", "sh", "-c", "echo line one; echo line two >&2; exit 3")
	if code != 3 {
		t.Errorf("exit %d, want the step's 3", code)
	}
	if out != "" {
		t.Errorf("stdout %q, want nothing", out)
	}
	want := "building... failed after "
	if !strings.HasPrefix(errOut, want) || !strings.Contains(errOut, "(exit status 3)") ||
		!strings.Contains(errOut, "line one\n") || !strings.Contains(errOut, "line two\n") {
		t.Errorf("stderr %q, want %q..., the exit status and both lines of output", errOut, want)
	}
}

func TestStepVerboseStreamsTheOutput(t *testing.T) {
	code, _, errOut := script(t, []string{"SPILLWAY_VERBOSE=1"}, "./step.sh", "saying hello", "sh", "-c", "echo go: added a v1")
	if code != 0 || !strings.Contains(errOut, "saying hello...\ngo: added a v1\nsaying hello: done in ") {
		t.Errorf("exit %d, stderr %q; want the step's output between its start and end lines", code, errOut)
	}
}

// TestStepStopsAFunctionAtItsFirstFailure runs a shell function as a step from
// an `||`, where bash would otherwise ignore errexit inside the function.
func TestStepStopsAFunctionAtItsFirstFailure(t *testing.T) {
	body := `set -euo pipefail
source ./step.sh
build() { echo started; false; echo "went on after a failure"; }
export -f build
step "building" build || echo "the caller saw the failure"
`
	code, out, errOut := script(t, nil, "bash", "-c", body)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	if strings.Contains(errOut, "went on") || !strings.Contains(errOut, "started") || !strings.Contains(out, "the caller saw the failure") {
		t.Errorf("stdout %q, stderr %q: want the step stopped at false and its failure returned", out, errOut)
	}
}

// TestSetupEnvtestShowsTheGoErrorWhenABuildFails builds an etcd version that
// does not exist, offline: one line for the step, then go's own error.
func TestSetupEnvtestShowsTheGoErrorWhenABuildFails(t *testing.T) {
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("go is not on PATH")
	}
	env, dest := cachedMachine(t)
	if err := os.Remove(filepath.Join(dest, "etcd")); err != nil {
		t.Fatal(err)
	}
	env = append(env, "ETCD_VERSION=0.0.0-missing", "GOPROXY=off", "GOFLAGS=")
	code, out, errOut := script(t, env, "./setup-envtest.sh")
	if code == 0 {
		t.Fatalf("exit 0, stdout %q, stderr %q; want a failure", out, errOut)
	}
	if out != "" {
		t.Errorf("stdout %q, want no directory when the build failed", out)
	}
	first, rest, _ := strings.Cut(errOut, "\n")
	if !strings.HasPrefix(first, "building etcd v0.0.0-missing for envtest") || !strings.Contains(first, "failed after") {
		t.Errorf("first line %q, want the step's failure", first)
	}
	if !strings.Contains(rest, "go.etcd.io/etcd/server/v3@v0.0.0-missing") {
		t.Errorf("the output after the step's line does not show go's error:\n%s", rest)
	}
	if _, err := os.Stat(filepath.Join(dest, "etcd")); err == nil {
		t.Error("etcd is in the cache after a failed build")
	}
}

// fakeApt is a PATH on which apt-get prints apt's noise and, when asked to
// install redis-sentinel, installs a stand-in (or fails, when fail is set);
// sudo, service and systemctl do nothing harmful.
func fakeApt(t *testing.T, fail bool) []string {
	t.Helper()
	for _, pidfile := range []string{"/run/redis/redis-server.pid", "/run/sentinel/redis-sentinel.pid"} {
		if _, err := os.Stat(pidfile); err == nil {
			t.Skipf("%s exists: setup-redis.sh would stop that service", pidfile)
		}
	}
	bin := t.TempDir()
	for _, name := range []string{"redis-server", "redis-cli"} {
		executable(t, filepath.Join(bin, name))
	}
	writeFakeApt(t, bin, "redis-sentinel", fail)
	return onlyPath(t, bin)
}

// writeFakeApt writes quietTools to bin, and an apt-get that prints apt's
// noise and, when asked to install anything, installs a stand-in for the
// program pkg (or fails to find package pkg, when fail is set).
func writeFakeApt(t *testing.T, bin, pkg string, fail bool) {
	t.Helper()
	install := `cp "$0" "$(dirname "$0")/` + pkg + `"; echo "Setting up ` + pkg + `"`
	if fail {
		install = `echo "E: Unable to locate package ` + pkg + `"; exit 100`
	}
	writeScripts(t, bin, quietTools)
	writeScripts(t, bin, map[string]string{
		"apt-get": `while [ "$1" = -o ]; do shift 2; done
case "$1" in
update) for i in $(seq 40); do echo "Get:$i http://deb.debian.org/debian trixie InRelease"; done ;;
install) [ "$DEBIAN_FRONTEND" = noninteractive ] || { echo "DEBIAN_FRONTEND=$DEBIAN_FRONTEND"; exit 1; }
  echo "Reading package lists..."; ` + install + ` ;;
esac`,
	})
}

// onlyPath writes bin's fake tools' environment: a PATH of bin alone, so that
// a real redis-sentinel or prometheus is not found, with the tools the
// scripts and fakes use linked into it.
func onlyPath(t *testing.T, bin string) []string {
	t.Helper()
	for _, tool := range []string{"bash", "sh", "env", "id", "mktemp", "rm", "cat", "cp", "seq", "dirname", "tr", "mkdir", "touch"} {
		path, err := exec.LookPath(tool)
		if err != nil {
			t.Skipf("%s is not installed", tool)
		}
		if err := os.Symlink(path, filepath.Join(bin, tool)); err != nil {
			t.Fatal(err)
		}
	}
	return []string{"PATH=" + bin, "SPILLWAY_VERBOSE=", "PROMETHEUS=", "SPILLWAY_PYTHON="}
}

// writeScripts writes each body as the shell script bin/name.
func writeScripts(t *testing.T, bin string, scripts map[string]string) {
	t.Helper()
	for name, body := range scripts {
		if err := os.WriteFile(filepath.Join(bin, name), []byte("#!/bin/sh\n"+body+"\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
}

// quietTools are sudo, service and systemctl that do nothing harmful; sudo
// drops the environment as the real one does.
var quietTools = map[string]string{
	"sudo":      `[ "$1" = -v ] && exit 0; unset DEBIAN_FRONTEND; exec "$@"`,
	"service":   `exit 0`,
	"systemctl": `exit 0`,
}

// fakeAptForPython is a PATH and a python3 (SPILLWAY_PYTHON) that has every
// module the Python client's tests need but celery; apt-get prints apt's noise
// and installs python3-celery only once its index has been refreshed (or
// never, when fail is set), as on a machine whose index is stale.
func fakeAptForPython(t *testing.T, fail bool) []string {
	t.Helper()
	bin := t.TempDir()
	python := fakePython(t, bin, "redis", "pytest", "prometheus_client", "requests", "urllib3", "httpx", "grpc")
	refresh := `touch "$(dirname "$0")/updated"`
	if fail {
		refresh = `:`
	}
	writeScripts(t, bin, quietTools)
	writeScripts(t, bin, map[string]string{
		"apt-get": `while [ "$1" = -o ]; do shift 2; done
dir="$(dirname "$0")"
case "$1" in
update) for i in $(seq 40); do echo "Get:$i http://deb.debian.org/debian trixie InRelease"; done; ` + refresh + ` ;;
install) [ "$DEBIAN_FRONTEND" = noninteractive ] || { echo "DEBIAN_FRONTEND=$DEBIAN_FRONTEND"; exit 1; }
  echo "Reading package lists..."
  shift
  for package in "$@"; do
    case "${package}" in -*) continue ;; esac
    [ -e "${dir}/updated" ] || { echo "E: Unable to locate package ${package}"; exit 100; }
    module="$(echo "${package#python3-}" | tr - _)"
    mkdir -p "${dir}/modules/${module}" && touch "${dir}/modules/${module}/installed"
    echo "Setting up ${package}"
  done ;;
esac`,
	})
	return append(onlyPath(t, bin), "SPILLWAY_PYTHON="+python)
}

// fakeAptForPrometheus is a PATH on which apt-get prints apt's noise and
// installs a stand-in prometheus (or fails, when fail is set).
func fakeAptForPrometheus(t *testing.T, fail bool) []string {
	t.Helper()
	if _, err := os.Stat("/run/prometheus/prometheus.pid"); err == nil {
		t.Skip("/run/prometheus/prometheus.pid exists: setup-prometheus.sh would stop that service")
	}
	bin := t.TempDir()
	writeFakeApt(t, bin, "prometheus", fail)
	return onlyPath(t, bin)
}

// aptScripts are the setup scripts that install Debian packages, each with
// the fake tools it is tested with (fail makes apt-get fail to install).
var aptScripts = []struct {
	name string
	fake func(t *testing.T, fail bool) []string
}{
	{"./setup-redis.sh", fakeApt},
	{"./setup-python.sh", fakeAptForPython},
	{"./setup-prometheus.sh", fakeAptForPrometheus},
}

// setTool replaces the fake tool name on the PATH of env (a PATH of one
// directory, from onlyPath) with a shell script of body, or removes it when
// body is empty.
func setTool(t *testing.T, env []string, name, body string) {
	t.Helper()
	bin, ok := strings.CutPrefix(env[0], "PATH=")
	if !ok || strings.Contains(bin, string(os.PathListSeparator)) {
		t.Fatalf("env[0] = %q, want a PATH of one directory", env[0])
	}
	if err := os.Remove(filepath.Join(bin, name)); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	if body != "" {
		writeScripts(t, bin, map[string]string{name: body})
	}
}

func TestSetupScriptsInstallQuietly(t *testing.T) {
	want := map[string]*regexp.Regexp{
		"./setup-redis.sh":      regexp.MustCompile(`^updating Debian's package lists\.\.\. done in \d+s\ninstalling Debian's redis-sentinel package\(s\)\.\.\. done in \d+s\n$`),
		"./setup-python.sh":     regexp.MustCompile(`^installing Debian's python3-celery package\(s\)\.\.\. done in \d+s\n$`),
		"./setup-prometheus.sh": regexp.MustCompile(`^installing Debian's prometheus package\.\.\. done in \d+s\n$`),
	}
	for _, s := range aptScripts {
		for _, root := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/root=%t", s.name, root), func(t *testing.T) {
				env := s.fake(t, false)
				if !root {
					// apt-get then runs through the fake sudo, which drops
					// DEBIAN_FRONTEND as the real one does.
					setTool(t, env, "id", `echo 1000`)
				}
				code, out, errOut := script(t, env, s.name)
				if code != 0 || out != "" || !want[s.name].MatchString(errOut) {
					t.Errorf("exit %d, stdout %q, stderr %q; want one line per apt step", code, out, errOut)
				}
			})
		}
	}
}

func TestSetupScriptsShowAptsErrorWhenItFails(t *testing.T) {
	tests := map[string]struct {
		exit int
		want []string
	}{
		// Only the sentinel is missing: the tests fall back to redis-server --sentinel.
		"./setup-redis.sh": {0, []string{
			"installing Debian's redis-sentinel package(s)... failed after ",
			"Reading package lists...\nE: Unable to locate package redis-sentinel\n",
			"setup-redis: apt-get install redis-sentinel failed; redis-sentinel not installed, the tests run redis-server --sentinel instead\n",
		}},
		"./setup-python.sh": {1, []string{
			"installing Debian's python3-celery package(s)... failed after ",
			"Get:40 http://deb.debian.org/debian trixie InRelease\nReading package lists...\nE: Unable to locate package python3-celery\n",
			"setup-python: apt-get install python3-celery failed\n",
		}},
		"./setup-prometheus.sh": {1, []string{
			"installing Debian's prometheus package... failed after ",
			"Reading package lists...\nE: Unable to locate package prometheus\n",
			"setup-prometheus: apt-get install prometheus failed\n",
		}},
	}
	for _, s := range aptScripts {
		t.Run(s.name, func(t *testing.T) {
			code, _, errOut := script(t, s.fake(t, true), s.name)
			tc := tests[s.name]
			if code != tc.exit {
				t.Errorf("exit %d, want %d", code, tc.exit)
			}
			for _, want := range tc.want {
				if !strings.Contains(errOut, want) {
					t.Errorf("stderr does not contain %q:\n%s", want, errOut)
				}
			}
		})
	}
}

// TestSetupScriptsSayWhatToDoWithoutApt checks each script's messages when
// it cannot run apt-get: no apt-get, or not root and sudo missing or failing.
// Redis only lacks redis-sentinel there, which the tests do without.
func TestSetupScriptsSayWhatToDoWithoutApt(t *testing.T) {
	const noSentinel = "; redis-sentinel not installed, the tests run redis-server --sentinel instead\n"
	tests := []struct {
		what  string
		tools map[string]string // fake tools replaced ("" removes one)
		want  map[string]string // script: its message
	}{
		{"no apt-get", map[string]string{"apt-get": ""}, map[string]string{
			"./setup-redis.sh":      "setup-redis: apt-get not found: install redis-server (7 or newer) and redis-sentinel with your package manager" + noSentinel,
			"./setup-python.sh":     "setup-python: apt-get not found: install python3-celery (or their equivalents for PYTHON) by hand\n",
			"./setup-prometheus.sh": "setup-prometheus: apt-get not found: install a prometheus server (2.x) with your package manager, or set PROMETHEUS to its binary\n",
		}},
		{"no sudo", map[string]string{"id": "echo 1000", "sudo": ""}, map[string]string{
			"./setup-redis.sh":      "setup-redis: not root and sudo is not installed: install the redis-sentinel package(s) by hand" + noSentinel,
			"./setup-python.sh":     "setup-python: not root and sudo is not installed: install python3-celery by hand\n",
			"./setup-prometheus.sh": "setup-prometheus: not root and sudo is not installed: install the prometheus package by hand, or set PROMETHEUS to a prometheus binary\n",
		}},
		{"sudo fails", map[string]string{"id": "echo 1000", "sudo": "echo 'sudo: a password is required' >&2; exit 1"}, map[string]string{
			"./setup-redis.sh":      "sudo: a password is required\nsetup-redis: sudo failed: install the redis-sentinel package(s) by hand" + noSentinel,
			"./setup-python.sh":     "sudo: a password is required\nsetup-python: sudo failed: install python3-celery by hand\n",
			"./setup-prometheus.sh": "sudo: a password is required\nsetup-prometheus: sudo failed: install the prometheus package by hand, or set PROMETHEUS to a prometheus binary\n",
		}},
	}
	for _, tc := range tests {
		for _, s := range aptScripts {
			t.Run(tc.what+"/"+s.name, func(t *testing.T) {
				env := s.fake(t, false)
				for name, body := range tc.tools {
					setTool(t, env, name, body)
				}
				want := tc.want[s.name]
				for _, v := range env {
					if python, ok := strings.CutPrefix(v, "SPILLWAY_PYTHON="); ok && python != "" {
						want = strings.ReplaceAll(want, "PYTHON", python)
					}
				}
				wantExit := 1
				if s.name == "./setup-redis.sh" {
					wantExit = 0
				}
				code, out, errOut := script(t, env, s.name)
				if code != wantExit || out != "" || errOut != want {
					t.Errorf("exit %d, stdout %q, stderr %q; want exit %d and stderr %q", code, out, errOut, wantExit, want)
				}
			})
		}
	}
}
