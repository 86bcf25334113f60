package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"text/tabwriter"
	"time"

	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"github.com/spillway-dev/spillway/internal/replay"
)

// runDemo replays an outage for real on loopback: it starts kube-apiserver,
// etcd and redis-server, runs the controller, applies the default policy and
// a ScaledObject, and drains the backlog through the worker library while the
// terminal shows the breaker, the limit, the ScaledObject's bounds, the
// backlog and the dependency's load. With --compare it then runs the same
// outage without Spillway.
func runDemo(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	plotFile := fs.String("plot", "spillway-demo.png", "write the dependency's load over time to this PNG (empty: none)")
	compare := fs.Bool("compare", true, "also replay the outage without Spillway, to see the second outage it prevents")
	interval := fs.Duration("evaluation-interval", 200*time.Millisecond, "how often the controller evaluates the policy")
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	logFile, err := logControllerToFile()
	if err != nil {
		fmt.Fprintln(stderr, "spillway demo:", err)
		return exitFailure
	}
	if err := demo(ctx, stdout, *plotFile, *compare, *interval); err != nil {
		fmt.Fprintln(stderr, "spillway demo:", err)
		fmt.Fprintln(stderr, "The controller's log is in", logFile)
		return exitFailure
	}
	_ = os.Remove(logFile)
	return exitOK
}

// logControllerToFile sends the logs of the controller (controller-runtime)
// and of client-go (klog) to a temporary file, so that the terminal shows the
// replay, and so that controller-runtime does not print a stack trace about
// log.SetLogger never being called. The demo keeps the file when it fails.
// The file stays open until the process exits: the manager's goroutines may
// still log while they stop.
func logControllerToFile() (path string, err error) {
	f, err := os.CreateTemp("", "spillway-demo-*.log")
	if err != nil {
		return "", fmt.Errorf("failed to create the controller's log file: %w", err)
	}
	logger := zap.New(zap.WriteTo(f))
	ctrl.SetLogger(logger)
	klog.SetLogger(logger)
	return f.Name(), nil
}

func demo(ctx context.Context, out io.Writer, plotFile string, compare bool, interval time.Duration) error {
	fmt.Fprintln(out, "Starting kube-apiserver, etcd and redis-server on loopback, and the controller...")
	cp, err := replay.StartControlPlane(ctx, interval)
	if err != nil {
		return err
	}
	defer func() {
		fmt.Fprintln(out, "Stopping the control plane and Redis.")
		cp.Stop()
	}()

	w, spec, cfg := replay.DefaultWorkload, replay.DefaultPolicy(), replay.DefaultConfig()
	fleet, err := cp.Install(ctx, w, spec, replay.DefaultMinReplicas, replay.DefaultMaxReplicas)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "Applied DependencyPolicy %s/%s (capacity %d, ramp %v every %v) and ScaledObject %s (min %d, max %d).\n",
		w.Namespace, w.Policy, spec.Capacity.Concurrency, spec.Ramp.Steps, spec.Ramp.StepDuration.Duration,
		w.ScaledObject, replay.DefaultMinReplicas, replay.DefaultMaxReplicas)
	bound := int(spec.Capacity.Concurrency / spec.Consumers[0].SlotsPerReplica)
	if err := cp.WaitBounded(ctx, w, fleet, bound); err != nil {
		return err
	}
	fmt.Fprintf(out, "The controller bounded the ScaledObject to %d replicas (%d slots each = capacity %d).\n\n",
		bound, spec.Consumers[0].SlotsPerReplica, spec.Capacity.Concurrency)
	fmt.Fprintf(out, "Replaying: %v of normal traffic (%.0f jobs/s), a %v outage, then the recovery.\n",
		cfg.Warm, cfg.ArrivalRate, cfg.Outage)

	progress := func(s replay.Sample) { fmt.Fprintln(out, s) }
	protected, err := replay.Run(ctx, cfg, fleet, progress)
	if err != nil {
		return err
	}
	results := []replay.Result{protected}
	if compare {
		fmt.Fprintln(out, "\nThe same outage without Spillway (immediate retries, autoscaler unbounded):")
		naiveCfg := cfg
		naiveCfg.MaxRecovery = 12 * time.Second // it does not drain; long enough to see it fall over again
		naive, err := replay.Run(ctx, naiveCfg, replay.Fleet{}, progress)
		if err != nil {
			return err
		}
		results = append(results, naive)
	}
	if plotFile != "" {
		if err := plotReplay(plotFile, cfg, results); err != nil {
			return err
		}
		fmt.Fprintf(out, "\nWrote %s.\n", plotFile)
	}
	fmt.Fprintln(out)
	writeReplaySummary(out, cfg, results)
	if protected.SecondOutages > 0 || protected.Lost > 0 || protected.OverLimit > 0 {
		return errors.New("the protected replay did not keep the dependency up")
	}
	return nil
}

func fleetName(r replay.Result) string {
	if r.Protected {
		return "spillway"
	}
	return "no protection"
}

func writeReplaySummary(out io.Writer, cfg replay.Config, results []replay.Result) {
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "fleet\tsecond outages\tpeak in flight\tcapacity\tbacklog\tdrain s\tpredicted s\tdone\tstale\tsuperseded\tparked\tpending\tlost\tcalls\t")
	for _, r := range results {
		drain, predicted := "never", "-"
		if r.DrainSeconds >= 0 {
			drain = fmt.Sprintf("%.1f", r.DrainSeconds)
			predicted = fmt.Sprintf("%.1f", r.PredictedDrainSeconds)
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t\n",
			fleetName(r), r.SecondOutages, r.PeakInFlight, cfg.Dependency.Capacity, r.Backlog, drain, predicted,
			r.Completed, r.Stale, r.Superseded, r.Parked, r.Pending, r.Lost, r.Calls)
	}
	_ = tw.Flush()
}
