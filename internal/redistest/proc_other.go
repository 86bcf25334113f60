//go:build !linux

package redistest

import "syscall"

// sysProcAttr puts redis-server in its own process group, so it and any child
// it forks can be signalled together.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}
