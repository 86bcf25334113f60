package replay

import (
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
	"github.com/spillway-dev/spillway/internal/policy"
)

// The default replay is the seeds' email incident scaled down to seconds: a
// dependency that serves 10 calls at once (50 ms each, 200 calls/s), cold at
// 60% for 3 s after it comes back and knocked over by 0.5 s of overload;
// 80 jobs/s of steady traffic, a fifth with a 3 s deadline (login codes) and a
// fifth superseded by newer versions; a 4 s outage; workers of 2 slots
// autoscaled on queue depth between 3 and 30 replicas.

// DefaultWorkload names the objects the default replay installs.
var DefaultWorkload = Workload{
	Namespace:    "mail",
	Policy:       "template-api",
	ScaledObject: "render-workers",
	Deployment:   "render-workers",
}

// User's own ScaledObject bounds in the default replay.
const (
	DefaultMinReplicas = 3
	DefaultMaxReplicas = 30
)

// DefaultPolicy is the DependencyPolicy of the default replay: the sample's
// shape with durations scaled from minutes to seconds.
func DefaultPolicy() spillwayv1alpha1.DependencyPolicySpec {
	d := func(v time.Duration) metav1.Duration { return metav1.Duration{Duration: v} }
	minRetries := int32(10)
	pin := true
	return spillwayv1alpha1.DependencyPolicySpec{
		Capacity: spillwayv1alpha1.Capacity{Concurrency: 10},
		Ramp:     spillwayv1alpha1.Ramp{Steps: []int32{2, 5, 10}, StepDuration: d(1500 * time.Millisecond)},
		Breaker: spillwayv1alpha1.Breaker{
			FailureRatio: 0.5, MinCalls: 10, HalfOpenProbes: 2,
			Window: d(2 * time.Second), OpenDuration: d(2 * time.Second),
		},
		RetryBudget: spillwayv1alpha1.RetryBudget{Ratio: 0.2, MinRetries: &minRetries, Window: d(5 * time.Second)},
		Backoff:     spillwayv1alpha1.Backoff{Base: d(100 * time.Millisecond), Max: d(time.Second), Jitter: spillwayv1alpha1.JitterFull},
		Consumers: []spillwayv1alpha1.Consumer{{
			ScaledObjectName: DefaultWorkload.ScaledObject, SlotsPerReplica: 2, Weight: 1,
		}},
		PinMinReplicasDuringOutage: &pin,
	}
}

// DefaultConfig is the default replay's traffic, outage and fleet.
func DefaultConfig() Config {
	spec := DefaultPolicy()
	params, err := policy.FromSpec(spec)
	if err != nil {
		panic(err) // the default policy is valid; a test proves it
	}
	return Config{
		Dependency: DependencyConfig{
			Capacity: 10, ServiceTime: 50 * time.Millisecond,
			ColdFactor: 0.6, WarmUp: 3 * time.Second,
			CollapseAfter: 500 * time.Millisecond, DownFor: 2 * time.Second,
		},
		ArrivalRate: 80,
		Warm:        3 * time.Second, Outage: 4 * time.Second, MaxRecovery: 30 * time.Second,
		DeadlineShare: 0.2, Deadline: 3 * time.Second,
		SupersedeShare: 0.2, Keys: 20,
		SlotsPerReplica: 2, MinReplicas: DefaultMinReplicas, MaxReplicas: DefaultMaxReplicas, JobsPerReplica: 5,
		ScaleInterval: 250 * time.Millisecond, SampleEvery: 250 * time.Millisecond,
		NaiveRetryDelay: 20 * time.Millisecond,
		Capacity:        params.Capacity,
		Ramp:            params.Ramp,
		Seed:            1,
	}
}
