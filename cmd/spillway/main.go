// Command spillway is Spillway's command-line tool. simulate replays an
// outage in virtual time against the shipped breaker, ramp, backoff and
// retry-budget code, for several caller policies side by side; demo replays
// one for real on loopback, with the control plane, Redis, the controller and
// workers using the library; status shows what Spillway is doing to a
// cluster's fleets now.
package main

import (
	"fmt"
	"io"
	"os"
)

// Exit codes.
const (
	exitOK      = 0
	exitFailure = 1
	exitUsage   = 2
)

// command is one subcommand.
type command struct {
	name    string
	summary string
	run     func(args []string, stdout, stderr io.Writer) int
}

// commands lists the subcommands; add new ones here.
var commands = []command{
	{name: "simulate", summary: "replay an outage and compare retry policies", run: runSimulate},
	{name: "demo", summary: "replay an outage for real on loopback: control plane, Redis, controller, workers", run: runDemo},
	{name: "status", summary: "show each DependencyPolicy's state, limit, ramp, load and consumers, from the cluster and Redis", run: runStatus},
}

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run is the whole program: it returns the exit code instead of exiting, so
// that tests can call it in-process.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		usage(stderr)
		return exitUsage
	}
	name := args[0]
	switch name {
	case "help", "-h", "-help", "--help":
		usage(stdout)
		return exitOK
	}
	for _, c := range commands {
		if c.name == name {
			return c.run(args[1:], stdout, stderr)
		}
	}
	fmt.Fprintf(stderr, "spillway: unknown command %q\n\n", name)
	usage(stderr)
	return exitUsage
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "Usage: spillway <command> [flags]")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Commands:")
	for _, c := range commands {
		fmt.Fprintf(w, "  %-10s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Run 'spillway <command> -h' for the flags of a command.")
}
