// Package proctest holds the process plumbing that the test-server packages
// (internal/redistest, internal/promtest) share: finding a binary, picking a
// free loopback port, starting a process in its own process group with its
// output in a log file, killing it, and reading the end of its log.
package proctest

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"syscall"
)

// LookPath finds the program name: the path in the environment variable
// envVar if it is set (an error if nothing is there), else name on PATH, else
// /usr/bin/name. When it finds nothing its error ends with hint, which tells
// a reader how to install the program.
func LookPath(name, envVar, hint string) (string, error) {
	if bin := os.Getenv(envVar); bin != "" {
		if _, err := os.Stat(bin); err != nil {
			return "", fmt.Errorf("%s=%s: %w", envVar, bin, err)
		}
		return bin, nil
	}
	if bin, err := exec.LookPath(name); err == nil {
		return bin, nil
	}
	fallback := "/usr/bin/" + name
	if _, err := os.Stat(fallback); err == nil {
		return fallback, nil
	}
	return "", errors.New(name + " not found in $" + envVar + ", on PATH or at " + fallback + ": " + hint)
}

// FreePort asks the kernel for a free loopback port. Another process may take
// it before the caller's server binds it; callers retry when that happens.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// Tail returns the last n lines of the file at path, or a note saying why it
// cannot.
func Tail(path string, n int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(cannot read %s: %v)", path, err)
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// ReadFrom returns the contents of the file at path from offset on, or "" if
// it cannot be read or is shorter.
func ReadFrom(path string, offset int64) string {
	data, err := os.ReadFile(path)
	if err != nil || offset > int64(len(data)) {
		return ""
	}
	return string(data[offset:])
}

// Proc is a process started by [Start], in its own process group.
type Proc struct {
	cmd    *exec.Cmd
	exited chan struct{} // closed once cmd has exited and been waited for
}

// Start runs bin with args in dir, its standard output and error going to
// log, in a new process group that [Proc.Kill] and [Proc.Signal] address as
// a whole. On Linux the kernel also kills the process if the test binary
// dies without running its cleanups (for example on a test timeout).
func Start(bin string, args []string, dir string, log *os.File) (*Proc, error) {
	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	p := &Proc{cmd: cmd, exited: make(chan struct{})}
	go func() {
		cmd.Wait() // the exit status is of no interest: the log explains failures
		close(p.exited)
	}()
	return p, nil
}

// Pid is the process id.
func (p *Proc) Pid() int { return p.cmd.Process.Pid }

// Exited is closed once the process has exited.
func (p *Proc) Exited() <-chan struct{} { return p.exited }

// Signal sends sig to the process group.
func (p *Proc) Signal(sig syscall.Signal) error {
	return syscall.Kill(-p.cmd.Process.Pid, sig) // the negative pid addresses the group
}

// Kill kills the process group with SIGKILL, which also ends a stopped
// (SIGSTOP) process, and waits for the process to exit. Killing an exited
// process does nothing.
func (p *Proc) Kill() {
	select {
	case <-p.exited: // crashed or failed to start; nothing to kill
	default:
		p.Signal(syscall.SIGKILL)
		<-p.exited
	}
}
