package status

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"time"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	"github.com/redis/go-redis/v9"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
)

// Exit codes of Run.
const (
	ExitOK      = 0
	ExitFailure = 1
	ExitUsage   = 2
)

// Flags are the flags of `status`.
type Flags struct {
	Namespace     string
	AllNamespaces bool
	Output        string
	Watch         bool
	WatchInterval time.Duration
	Kubeconfig    string
	Context       string
	Redis         RedisOptions
	// Names are the policies to show; all when empty.
	Names []string
}

// ParseFlags parses the arguments of `status`: flags, kubectl's way, and
// policy names, in any order.
func ParseFlags(prog string, args []string, stderr io.Writer) (Flags, error) {
	var f Flags
	fs := flag.NewFlagSet(prog, flag.ContinueOnError)
	fs.SetOutput(stderr)
	for _, n := range []string{"n", "namespace"} {
		fs.StringVar(&f.Namespace, n, "", "the `namespace` of the policies (default: the kubeconfig context's)")
	}
	for _, n := range []string{"A", "all-namespaces"} {
		fs.BoolVar(&f.AllNamespaces, n, false, "show the policies of every namespace")
	}
	for _, n := range []string{"o", "output"} {
		fs.StringVar(&f.Output, n, "", "output `format`: wide, json or yaml (default: a table)")
	}
	for _, n := range []string{"w", "watch"} {
		fs.BoolVar(&f.Watch, n, false, "print the status again every --watch-interval until interrupted")
	}
	fs.DurationVar(&f.WatchInterval, "watch-interval", 2*time.Second, "how often --watch reads again")
	fs.StringVar(&f.Kubeconfig, "kubeconfig", "", "path to the kubeconfig `file` (default: $KUBECONFIG, then ~/.kube/config)")
	fs.StringVar(&f.Context, "context", "", "the kubeconfig `context` to use (default: the current context)")
	f.Redis.BindFlags(fs)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: %s [NAME...] [flags]\n\n", prog)
		fmt.Fprintln(fs.Output(), "One line per DependencyPolicy, from the cluster and from Redis. It only reads:")
		fmt.Fprintln(fs.Output(), "from Redis the state (a read-only script: HGETALL, TIME), the breaker window's")
		fmt.Fprintln(fs.Output(), "counters (HMGET) and the live leases (ZCOUNT); a Redis user allowed only to read")
		fmt.Fprintln(fs.Output(), "(+@read +@connection +time +eval +evalsha) is enough. Flags:")
		fs.PrintDefaults()
	}
	for {
		if err := fs.Parse(args); err != nil {
			return Flags{}, err
		}
		if fs.NArg() == 0 {
			break
		}
		f.Names = append(f.Names, fs.Arg(0))
		args = fs.Args()[1:]
	}
	if err := f.Redis.Complete(fs); err != nil {
		return Flags{}, err
	}
	switch {
	case f.Output != OutputTable && f.Output != OutputWide && f.Output != OutputJSON && f.Output != OutputYAML:
		return Flags{}, fmt.Errorf("unknown output format %q: use wide, json or yaml", f.Output)
	case f.AllNamespaces && len(f.Names) > 0:
		return Flags{}, errors.New("a policy name cannot be given with --all-namespaces")
	case f.WatchInterval <= 0:
		return Flags{}, errors.New("--watch-interval must be positive")
	}
	return f, nil
}

// Scheme knows the kinds status reads: DependencyPolicies, KEDA's
// ScaledObjects and the built-in kinds (HorizontalPodAutoscalers).
func Scheme() *runtime.Scheme {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{clientgoscheme.AddToScheme, spillwayv1alpha1.AddToScheme, kedav1alpha1.AddToScheme} {
		if err := add(s); err != nil {
			panic(fmt.Sprintf("failed to build the scheme: %v", err))
		}
	}
	return s
}

// Run is `status` (prog names it in messages): it returns the exit code.
// It stops at once, or with --watch when ctx ends.
func Run(ctx context.Context, prog string, args []string, stdout, stderr io.Writer) int {
	f, err := ParseFlags(prog, args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return ExitOK
	}
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", prog, err)
		return ExitUsage
	}
	// controller-runtime's client logs nothing a user needs here, and
	// warns when no logger is set.
	ctrllog.SetLogger(zap.New(zap.WriteTo(io.Discard)))
	redis.SetLogger(quietRedis{})
	kc, namespace, err := kubeClient(f)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", prog, err)
		return ExitFailure
	}
	rdb, err := f.Redis.NewClient()
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", prog, err)
		return ExitUsage
	}
	defer func() { _ = rdb.Close() }()
	r := &Reader{Client: kc, Redis: rdb, RedisTimeout: f.Redis.Timeout}
	if err := show(ctx, r, f, namespace, stdout, stderr); err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", prog, err)
		return ExitFailure
	}
	return ExitOK
}

// show reads and prints once, or with --watch every interval until ctx ends.
func show(ctx context.Context, r *Reader, f Flags, namespace string, stdout, stderr io.Writer) error {
	if f.AllNamespaces {
		namespace = ""
	}
	for first := true; ; first = false {
		rep, err := r.Read(ctx, namespace, f.Names)
		switch {
		case err != nil && !f.Watch:
			return err
		case err != nil && ctx.Err() != nil:
			return nil
		case err != nil:
			fmt.Fprintf(stderr, "%v\n", err)
		default:
			if rep.RedisUnreachable != "" {
				rep.RedisUnreachable = fmt.Sprintf("Redis at %s: %s", f.Redis.Where(), rep.RedisUnreachable)
			}
			if f.Watch && !first {
				separate(stdout, f.Output)
			}
			if err := Write(stdout, rep, f.Output, f.AllNamespaces); err != nil {
				return err
			}
		}
		if !f.Watch {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(f.WatchInterval):
		}
	}
}

// separate prints what goes between two refreshes of --watch.
func separate(w io.Writer, format string) {
	switch format {
	case OutputYAML:
		fmt.Fprintln(w, "---")
	case OutputJSON:
	default:
		fmt.Fprintln(w)
	}
}

// kubeClient is a client for the kubeconfig and context f names, and the
// namespace to read: -n, else the context's.
func kubeClient(f Flags) (client.Client, string, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = f.Kubeconfig
	overrides := &clientcmd.ConfigOverrides{CurrentContext: f.Context}
	overrides.Context.Namespace = f.Namespace
	cc := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, overrides)
	namespace, _, err := cc.Namespace()
	if err != nil {
		return nil, "", fmt.Errorf("failed to read the kubeconfig: %w", err)
	}
	cfg, err := cc.ClientConfig()
	if err != nil {
		return nil, "", fmt.Errorf("failed to read the kubeconfig: %w", err)
	}
	cfg.UserAgent = "spillway-status"
	c, err := client.New(cfg, client.Options{Scheme: Scheme()})
	if err != nil {
		return nil, "", fmt.Errorf("failed to create a client for %s: %w", cfg.Host, err)
	}
	return c, namespace, nil
}
