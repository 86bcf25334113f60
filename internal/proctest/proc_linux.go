package proctest

import "syscall"

// sysProcAttr puts the process in its own process group, so it and any child
// it forks can be signalled together, and has the kernel kill it if the test
// binary dies without running its cleanups (for example on a test timeout).
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
