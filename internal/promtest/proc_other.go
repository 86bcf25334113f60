//go:build !linux

package promtest

import "syscall"

// sysProcAttr puts prometheus in its own process group.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}
