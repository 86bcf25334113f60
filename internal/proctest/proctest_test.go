package proctest

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestLookPath(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "prog")
	if err := os.WriteFile(bin, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PROCTEST_BIN", bin)
	if got, err := LookPath("proctest-no-such-program", "PROCTEST_BIN", "hint"); err != nil || got != bin {
		t.Errorf("LookPath with env var = %q, %v; want %q", got, err, bin)
	}
	t.Setenv("PROCTEST_BIN", filepath.Join(dir, "missing"))
	if _, err := LookPath("sh", "PROCTEST_BIN", "hint"); err == nil || !strings.Contains(err.Error(), "PROCTEST_BIN=") {
		t.Errorf("LookPath with a missing env var path: err = %v, want PROCTEST_BIN=...", err)
	}
	t.Setenv("PROCTEST_BIN", "")
	t.Setenv("PATH", dir)
	if got, err := LookPath("prog", "PROCTEST_BIN", "hint"); err != nil || got != bin {
		t.Errorf("LookPath on PATH = %q, %v; want %q", got, err, bin)
	}
	_, err := LookPath("proctest-no-such-program", "PROCTEST_BIN", "run the setup script")
	if err == nil || !strings.HasSuffix(err.Error(), ": run the setup script") {
		t.Errorf("LookPath of a missing program: err = %v, want one ending with the hint", err)
	}
}

func TestTailAndReadFrom(t *testing.T) {
	path := filepath.Join(t.TempDir(), "log")
	if err := os.WriteFile(path, []byte("a\nb\nc\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := Tail(path, 2); got != "b\nc" {
		t.Errorf("Tail(2) = %q, want %q", got, "b\nc")
	}
	if got := Tail(path, 10); got != "a\nb\nc" {
		t.Errorf("Tail(10) = %q, want %q", got, "a\nb\nc")
	}
	if got := Tail(path+".missing", 2); !strings.HasPrefix(got, "(cannot read ") {
		t.Errorf("Tail of a missing file = %q, want a note", got)
	}
	if got := ReadFrom(path, 2); got != "b\nc\n" {
		t.Errorf("ReadFrom(2) = %q, want %q", got, "b\nc\n")
	}
	if got := ReadFrom(path, 100); got != "" {
		t.Errorf("ReadFrom past the end = %q, want empty", got)
	}
}

func TestStartKill(t *testing.T) {
	dir := t.TempDir()
	log, err := os.Create(filepath.Join(dir, "log"))
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	p, err := Start("/bin/sh", []string{"-c", "pwd; exec sleep 60"}, dir, log)
	if err != nil {
		t.Fatal(err)
	}
	// The process runs in dir with its output in the log.
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(Tail(log.Name(), 5), dir) {
		if time.Now().After(deadline) {
			t.Fatalf("log = %q, want the process's working directory %s", Tail(log.Name(), 5), dir)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := p.Signal(syscall.SIGSTOP); err != nil {
		t.Errorf("Signal(SIGSTOP): %v", err)
	}
	p.Kill() // SIGKILL ends a stopped process too
	select {
	case <-p.Exited():
	default:
		t.Fatal("Exited is open after Kill")
	}
	p.Kill() // killing an exited process does nothing
	if _, err := Start(filepath.Join(dir, "missing"), nil, dir, log); err == nil {
		t.Error("Start of a missing binary succeeded")
	}
}

func TestFreePort(t *testing.T) {
	port, err := FreePort()
	if err != nil || port <= 0 {
		t.Fatalf("FreePort = %d, %v", port, err)
	}
}
