//go:build !linux

package proctest

import "syscall"

// sysProcAttr puts the process in its own process group, so it and any child
// it forks can be signalled together.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}
