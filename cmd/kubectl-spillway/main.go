// Command kubectl-spillway is Spillway's kubectl plugin: installed on the
// PATH, it makes `kubectl spillway status` work, the same command as
// `spillway status` (internal/status).
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/spillway-dev/spillway/internal/status"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run is the plugin: it returns the exit code instead of exiting.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		usage(stderr)
		return status.ExitUsage
	}
	switch args[0] {
	case "status":
		return status.Run(ctx, "kubectl spillway status", args[1:], stdout, stderr)
	case "help", "-h", "-help", "--help":
		usage(stdout)
		return status.ExitOK
	}
	fmt.Fprintf(stderr, "kubectl spillway: unknown command %q\n\n", args[0])
	usage(stderr)
	return status.ExitUsage
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "Usage: kubectl spillway <command> [flags]")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Commands:")
	fmt.Fprintln(w, "  status     show each DependencyPolicy's state, limit, ramp, load and consumers, from the cluster and Redis")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Run 'kubectl spillway status -h' for its flags.")
}
