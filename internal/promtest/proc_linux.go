package promtest

import "syscall"

// sysProcAttr puts prometheus in its own process group and has the kernel
// kill it if the test binary dies without running its cleanups (for example
// on a test timeout).
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
