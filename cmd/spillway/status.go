package main

import (
	"context"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/spillway-dev/spillway/internal/status"
)

// runStatus is `spillway status`: one line per DependencyPolicy, from the
// cluster and from Redis (internal/status).
func runStatus(args []string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return status.Run(ctx, "spillway status", args, stdout, stderr)
}
