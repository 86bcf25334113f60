package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/spillway-dev/spillway/internal/policy"
	"github.com/spillway-dev/spillway/internal/sim"
)

// defaultScenario is replayed when no scenario is named.
const defaultScenario = "email-outage"

// simulateFlags are the flags of `spillway simulate`.
type simulateFlags struct {
	scenario     string
	scenarioFile string
	policyFile   string
	seed         uint64
	seedSet      bool
	json         bool
	plot         string
	sweep        string
	policies     string
	list         bool
}

// usageError is bad input: it is reported with exit code 2.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

func badInput(format string, args ...any) error {
	return usageError{fmt.Errorf(format, args...)}
}

// runSimulate is `spillway simulate`.
func runSimulate(args []string, stdout, stderr io.Writer) int {
	f, err := parseSimulateFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	if err != nil {
		return report(stderr, err)
	}
	if f.list {
		return report(stderr, list(stdout))
	}
	return report(stderr, simulate(f, stdout))
}

// report prints err, if any, and returns the exit code for it.
func report(stderr io.Writer, err error) int {
	if err == nil {
		return exitOK
	}
	fmt.Fprintf(stderr, "spillway simulate: %v\n", err)
	if errors.As(err, new(usageError)) {
		return exitUsage
	}
	return exitFailure
}

func parseSimulateFlags(args []string, stderr io.Writer) (simulateFlags, error) {
	var f simulateFlags
	fs := flag.NewFlagSet("spillway simulate", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&f.scenario, "scenario", "", "built-in scenario `NAME` to replay (default "+defaultScenario+"; see --list)")
	fs.StringVar(&f.scenarioFile, "scenario-file", "", "scenario `file` (YAML) to replay")
	fs.StringVar(&f.policyFile, "policy", "", "DependencyPolicy manifest `file` replacing the scenario's")
	fs.Uint64Var(&f.seed, "seed", 0, "`seed` of the random streams (default: the scenario's)")
	fs.BoolVar(&f.json, "json", false, "print JSON instead of a table")
	fs.StringVar(&f.plot, "plot", "", "write the dependency's request rate over time to `file` (PNG)")
	fs.StringVar(&f.sweep, "sweep", "", "vary one parameter: `PARAM=a,b,c` (see --list)")
	fs.StringVar(&f.policies, "policies", "", "comma-separated `policies` to run (default all)")
	fs.BoolVar(&f.list, "list", false, "list the built-in scenarios, policies and sweep parameters")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "Usage: spillway simulate [--scenario NAME | --scenario-file FILE] [--policy FILE.yaml] [--seed N]")
		fmt.Fprintln(stderr, "                         [--json] [--plot FILE.png] [--sweep PARAM=a,b,c] [--policies a,b]")
		fmt.Fprintln(stderr, "       spillway simulate --list")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return f, err
		}
		return f, usageError{err}
	}
	if fs.NArg() > 0 {
		return f, badInput("unexpected arguments: %s", strings.Join(fs.Args(), " "))
	}
	fs.Visit(func(fl *flag.Flag) { f.seedSet = f.seedSet || fl.Name == "seed" })
	if f.scenario != "" && f.scenarioFile != "" {
		return f, badInput("give --scenario or --scenario-file, not both")
	}
	if f.plot != "" && f.sweep != "" {
		return f, badInput("--plot draws one run; it cannot be combined with --sweep")
	}
	return f, nil
}

// simulate loads the scenario, runs it (once, or once per sweep value) and
// prints the results.
func simulate(f simulateFlags, stdout io.Writer) error {
	sc, err := loadScenario(f)
	if err != nil {
		return err
	}
	policies, err := sim.ParsePolicies(f.policies)
	if err != nil {
		return usageError{err}
	}
	if f.sweep == "" {
		rep, err := sim.Run(sc, policies)
		if err != nil {
			return usageError{err}
		}
		if f.plot != "" {
			if err := writePlot(f.plot, sc, rep); err != nil {
				return err
			}
		}
		if f.json {
			return writeJSON(stdout, rep)
		}
		return writeTable(stdout, sc, rep)
	}
	return sweep(f, sc, policies, stdout)
}

// loadScenario returns the scenario the flags name, with --policy and
// --seed applied.
func loadScenario(f simulateFlags) (*sim.Scenario, error) {
	var sc *sim.Scenario
	var err error
	switch {
	case f.scenarioFile != "":
		sc, err = sim.LoadScenarioFile(f.scenarioFile)
	case f.scenario != "":
		sc, err = sim.Builtin(f.scenario)
	default:
		sc, err = sim.Builtin(defaultScenario)
	}
	if err != nil {
		return nil, usageError{err}
	}
	if f.policyFile != "" {
		p, err := policy.LoadFile(f.policyFile)
		if err != nil {
			return nil, usageError{err}
		}
		sc.Policy = p
	}
	if f.seedSet {
		if err := sc.Set("seed", fmt.Sprint(f.seed)); err != nil {
			return nil, usageError{err}
		}
	}
	if sc.Policy == nil {
		return nil, badInput("scenario %q has no DependencyPolicy: add policy or policyFile, or pass --policy", sc.Name)
	}
	return sc, nil
}

// list prints the built-in scenarios, the policies and the sweep parameters.
func list(stdout io.Writer) error {
	fmt.Fprintln(stdout, "Scenarios:")
	for _, name := range sim.BuiltinNames() {
		sc, err := sim.Builtin(name)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "  %-16s %s\n", name, sc.Description)
	}
	fmt.Fprintln(stdout)
	fmt.Fprintln(stdout, "Policies (each adds one mechanism to the one before):")
	for _, p := range sim.Policies() {
		fmt.Fprintf(stdout, "  %s\n", p)
	}
	fmt.Fprintln(stdout)
	fmt.Fprintln(stdout, "Sweep parameters (--sweep PARAM=a,b,c):")
	for _, p := range sim.SweepParams() {
		fmt.Fprintf(stdout, "  %-14s %s\n", p[0], p[1])
	}
	return nil
}
