package sim

import (
	"errors"
	"fmt"
	"math"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	spillwayv1alpha1 "github.com/spillway-dev/spillway/api/v1alpha1"
)

// Scenario is an incident to replay: the steady load, the outage, the
// dependency, the worker fleet and the DependencyPolicy that the Spillway
// policies follow. The JSON names are those of the scenario file (YAML).
type Scenario struct {
	// Name identifies the scenario in reports.
	Name string `json:"name"`
	// Description says where the numbers come from.
	Description string `json:"description,omitempty"`
	// Seed seeds the random streams; the same seed gives the same report.
	// Defaults to 1.
	Seed uint64 `json:"seed,omitempty"`
	// Timeline places the outage in virtual time.
	Timeline Timeline `json:"timeline"`
	// Arrivals is the work the fleet receives.
	Arrivals Arrivals `json:"arrivals"`
	// Dependency is the service the workers call.
	Dependency Dependency `json:"dependency"`
	// Workers is the autoscaled worker fleet.
	Workers Workers `json:"workers"`
	// Policy is the DependencyPolicy, already defaulted and validated (see
	// policy.Load). The scenario file gives it inline under "policy" or as a
	// path under "policyFile".
	Policy *spillwayv1alpha1.DependencyPolicy `json:"-"`
}

// Timeline places the outage: the run starts at 0 with an empty queue, the
// dependency is down from Warmup (T0) to Warmup+Outage (T1, "recovery"),
// and the run ends at Horizon.
type Timeline struct {
	// Warmup is the steady operation before the outage, at least 10s; the
	// highest queue depth seen during it is the "drained" level. Defaults
	// to 1m.
	Warmup metav1.Duration `json:"warmup,omitempty"`
	// Outage is how long the dependency is down.
	Outage metav1.Duration `json:"outage"`
	// Horizon is when the run ends, measured from 0; after T1.
	Horizon metav1.Duration `json:"horizon"`
}

// Arrivals is the stream of new jobs.
type Arrivals struct {
	// RatePerSecond is the mean rate of new jobs (Poisson arrivals).
	RatePerSecond float64 `json:"ratePerSecond"`
	// Backlog is a number of extra jobs already queued when the outage
	// starts (a batch, or work that piled up earlier), on top of the jobs
	// that arrive during it.
	Backlog int64 `json:"backlog,omitempty"`
	// MaxAttempts is the number of calls a job may make before the caller
	// gives up on it, at most 65535; 0 means no limit.
	MaxAttempts int `json:"maxAttempts,omitempty"`
	// Classes split the jobs by type. Defaults to one class of durable jobs.
	Classes []JobClass `json:"classes,omitempty"`
}

// JobClass is one type of job.
type JobClass struct {
	// Name names the class.
	Name string `json:"name"`
	// Share is the fraction of jobs of this class; shares sum to 1.
	Share float64 `json:"share"`
	// Deadline, when set, is how long after it was enqueued a job of this
	// class stops being useful (a 5-minute login code).
	Deadline *metav1.Duration `json:"deadline,omitempty"`
	// Keys, when set, makes the class versioned: each job updates one of
	// Keys entities, drawn uniformly, and a newer job for the same entity
	// supersedes any older one still queued.
	Keys int `json:"keys,omitempty"`
}

// Dependency is the service the jobs call.
type Dependency struct {
	// Concurrency is how many calls it serves at once (C).
	Concurrency int `json:"concurrency"`
	// CallDuration is the service time of a call it serves (S), so its
	// throughput is Concurrency/CallDuration.
	CallDuration metav1.Duration `json:"callDuration"`
	// FailDuration is how long a call that fails takes to fail: while the
	// dependency is down, or when it is beyond capacity. Defaults to
	// CallDuration.
	FailDuration metav1.Duration `json:"failDuration,omitempty"`
	// ColdStart reduces capacity after each recovery.
	ColdStart ColdStart `json:"coldStart,omitempty"`
	// Collapse is the metastable failure under sustained overload.
	Collapse Collapse `json:"collapse"`
}

// ColdStart is the reduced capacity right after the dependency comes back.
type ColdStart struct {
	// Factor multiplies Concurrency while cold, in (0, 1]. Defaults to 1.
	Factor float64 `json:"factor,omitempty"`
	// Duration is how long the dependency stays cold after each recovery.
	Duration metav1.Duration `json:"duration,omitempty"`
}

// Collapse says when sustained overload takes the dependency down again.
type Collapse struct {
	// After is how many consecutive overloaded seconds make the dependency
	// fall over: seconds in which the work offered (slot-time served, plus
	// CallDuration for each call turned away for want of a slot) exceeds
	// the effective concurrency × 1 s.
	After metav1.Duration `json:"after"`
	// DownFor is how long it stays down when it does. Defaults to the
	// outage.
	DownFor metav1.Duration `json:"downFor,omitempty"`
}

// Workers is the worker fleet, scaled on queue depth as KEDA and the HPA do.
type Workers struct {
	// SlotsPerPod is the number of jobs one pod runs at once. Defaults to 1.
	SlotsPerPod int `json:"slotsPerPod,omitempty"`
	// MinReplicas and MaxReplicas bound the autoscaler.
	MinReplicas int `json:"minReplicas"`
	MaxReplicas int `json:"maxReplicas"`
	// TargetQueuePerReplica is the queue depth one pod is expected to
	// absorb (KEDA's target value): desired = ceil(depth / target).
	// Defaults to 100.
	TargetQueuePerReplica int `json:"targetQueuePerReplica,omitempty"`
	// PollingInterval is how often the autoscaler reads the queue depth, in
	// whole seconds. Defaults to 15s.
	PollingInterval metav1.Duration `json:"pollingInterval,omitempty"`
	// Cooldown is the scale-down stabilisation window: the fleet shrinks
	// only to the largest recommendation of the last Cooldown. Defaults to
	// 5m.
	Cooldown metav1.Duration `json:"cooldown,omitempty"`
	// StartupDelay is how long a new pod takes to start taking jobs.
	// Defaults to 30s.
	StartupDelay metav1.Duration `json:"startupDelay,omitempty"`
}

// maxJobs bounds the jobs of one run (at most 12¼ bytes each in the job
// table, per policy; see jobTable).
const maxJobs = 50_000_000

// T0 is when the outage starts.
func (s *Scenario) T0() time.Duration { return s.Timeline.Warmup.Duration }

// T1 is when the dependency recovers from the outage.
func (s *Scenario) T1() time.Duration { return s.T0() + s.Timeline.Outage.Duration }

// Default fills in the optional fields.
func (s *Scenario) Default() {
	if s.Seed == 0 {
		s.Seed = 1
	}
	setDuration(&s.Timeline.Warmup, time.Minute)
	if len(s.Arrivals.Classes) == 0 {
		s.Arrivals.Classes = []JobClass{{Name: "default", Share: 1}}
	}
	setDuration(&s.Dependency.FailDuration, s.Dependency.CallDuration.Duration)
	if s.Dependency.ColdStart.Factor == 0 {
		s.Dependency.ColdStart.Factor = 1
	}
	setDuration(&s.Dependency.Collapse.DownFor, s.Timeline.Outage.Duration)
	w := &s.Workers
	w.SlotsPerPod = max(w.SlotsPerPod, 1)
	if w.TargetQueuePerReplica == 0 {
		w.TargetQueuePerReplica = 100
	}
	setDuration(&w.PollingInterval, 15*time.Second)
	setDuration(&w.Cooldown, 5*time.Minute)
	setDuration(&w.StartupDelay, 30*time.Second)
}

func setDuration(d *metav1.Duration, v time.Duration) {
	if d.Duration == 0 {
		d.Duration = v
	}
}

// Validate returns an error naming every invalid field, or nil. It expects a
// defaulted scenario.
func (s *Scenario) Validate() error {
	var errs []error
	add := func(ok bool, field, format string, args ...any) {
		if !ok {
			errs = append(errs, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, args...)))
		}
	}
	add(s.Policy != nil, "policy", "a DependencyPolicy is required (policy or policyFile)")
	return errors.Join(append(errs, s.validateWorld()...)...)
}

// validateWorld checks everything but the policy.
func (s *Scenario) validateWorld() []error {
	var errs []error
	if s.Name == "" {
		errs = append(errs, errors.New("name: must not be empty"))
	}
	errs = append(errs, s.Timeline.validate()...)
	errs = append(errs, s.Arrivals.validate()...)
	if jobs := s.Arrivals.RatePerSecond*s.Timeline.Horizon.Seconds() + float64(s.Arrivals.Backlog); jobs > maxJobs {
		errs = append(errs, fmt.Errorf("arrivals: ratePerSecond x horizon + backlog must be at most %d jobs, got %.0f", maxJobs, jobs))
	}
	errs = append(errs, s.Dependency.validate()...)
	return append(errs, s.Workers.validate()...)
}

func (t Timeline) validate() []error {
	var errs []error
	if t.Warmup.Duration < 10*time.Second {
		errs = append(errs, fmt.Errorf("timeline.warmup: must be at least 10s, got %v", t.Warmup.Duration))
	}
	if t.Outage.Duration < time.Second {
		errs = append(errs, fmt.Errorf("timeline.outage: must be at least 1s, got %v", t.Outage.Duration))
	}
	if end := t.Warmup.Duration + t.Outage.Duration; t.Horizon.Duration <= end {
		errs = append(errs, fmt.Errorf("timeline.horizon: must be after the outage ends (%v), got %v", end, t.Horizon.Duration))
	}
	if t.Horizon.Duration > 24*time.Hour {
		errs = append(errs, fmt.Errorf("timeline.horizon: must be at most 24h, got %v", t.Horizon.Duration))
	}
	return errs
}

func (a Arrivals) validate() []error {
	var errs []error
	if !(a.RatePerSecond > 0 && a.RatePerSecond <= 1e5) {
		errs = append(errs, fmt.Errorf("arrivals.ratePerSecond: must be in (0, 100000], got %v", a.RatePerSecond))
	}
	if a.Backlog < 0 || a.Backlog > 1e7 {
		errs = append(errs, fmt.Errorf("arrivals.backlog: must be in [0, 10000000], got %d", a.Backlog))
	}
	if a.MaxAttempts < 0 || a.MaxAttempts > maxAttempts {
		errs = append(errs, fmt.Errorf("arrivals.maxAttempts: must be in [0, %d], got %d", maxAttempts, a.MaxAttempts))
	}
	var sum float64
	for i, c := range a.Classes {
		errs = append(errs, c.validate(fmt.Sprintf("arrivals.classes[%d]", i))...)
		sum += c.Share
	}
	if math.Abs(sum-1) > 1e-3 {
		errs = append(errs, fmt.Errorf("arrivals.classes: shares must sum to 1, got %v", sum))
	}
	return errs
}

func (c JobClass) validate(path string) []error {
	var errs []error
	if c.Name == "" {
		errs = append(errs, fmt.Errorf("%s.name: must not be empty", path))
	}
	if !(c.Share >= 0 && c.Share <= 1) {
		errs = append(errs, fmt.Errorf("%s.share: must be in [0, 1], got %v", path, c.Share))
	}
	if c.Deadline != nil && c.Deadline.Duration <= 0 {
		errs = append(errs, fmt.Errorf("%s.deadline: must be positive, got %v", path, c.Deadline.Duration))
	}
	if c.Keys < 0 || c.Keys > 1e7 {
		errs = append(errs, fmt.Errorf("%s.keys: must be in [0, 10000000], got %d", path, c.Keys))
	}
	return errs
}

func (d Dependency) validate() []error {
	var errs []error
	if d.Concurrency < 1 {
		errs = append(errs, fmt.Errorf("dependency.concurrency: must be at least 1, got %d", d.Concurrency))
	}
	if d.CallDuration.Duration < time.Millisecond {
		errs = append(errs, fmt.Errorf("dependency.callDuration: must be at least 1ms, got %v", d.CallDuration.Duration))
	}
	if d.FailDuration.Duration < time.Millisecond {
		errs = append(errs, fmt.Errorf("dependency.failDuration: must be at least 1ms, got %v", d.FailDuration.Duration))
	}
	if !(d.ColdStart.Factor > 0 && d.ColdStart.Factor <= 1) {
		errs = append(errs, fmt.Errorf("dependency.coldStart.factor: must be in (0, 1], got %v", d.ColdStart.Factor))
	}
	if d.ColdStart.Duration.Duration < 0 {
		errs = append(errs, fmt.Errorf("dependency.coldStart.duration: must not be negative, got %v", d.ColdStart.Duration.Duration))
	}
	if d.Collapse.After.Duration < time.Second {
		errs = append(errs, fmt.Errorf("dependency.collapse.after: must be at least 1s, got %v", d.Collapse.After.Duration))
	}
	if d.Collapse.DownFor.Duration < time.Second {
		errs = append(errs, fmt.Errorf("dependency.collapse.downFor: must be at least 1s, got %v", d.Collapse.DownFor.Duration))
	}
	return errs
}

func (w Workers) validate() []error {
	var errs []error
	if w.MinReplicas < 1 {
		errs = append(errs, fmt.Errorf("workers.minReplicas: must be at least 1, got %d", w.MinReplicas))
	}
	if w.MaxReplicas < w.MinReplicas || w.MaxReplicas > 10000 {
		errs = append(errs, fmt.Errorf("workers.maxReplicas: must be in [minReplicas, 10000], got %d", w.MaxReplicas))
	}
	if w.SlotsPerPod > 10000 {
		errs = append(errs, fmt.Errorf("workers.slotsPerPod: must be at most 10000, got %d", w.SlotsPerPod))
	}
	if w.TargetQueuePerReplica < 1 {
		errs = append(errs, fmt.Errorf("workers.targetQueuePerReplica: must be at least 1, got %d", w.TargetQueuePerReplica))
	}
	if p := w.PollingInterval.Duration; p < time.Second || p%time.Second != 0 {
		errs = append(errs, fmt.Errorf("workers.pollingInterval: must be a whole number of seconds, at least 1s, got %v", p))
	}
	if w.Cooldown.Duration < 0 || w.StartupDelay.Duration < 0 {
		errs = append(errs, fmt.Errorf("workers: cooldown and startupDelay must not be negative"))
	}
	return errs
}

// Clone returns a deep copy, so that a sweep can vary one copy per value.
func (s *Scenario) Clone() *Scenario {
	c := *s
	c.Arrivals.Classes = make([]JobClass, len(s.Arrivals.Classes))
	for i, class := range s.Arrivals.Classes {
		c.Arrivals.Classes[i] = class
		if class.Deadline != nil {
			d := *class.Deadline
			c.Arrivals.Classes[i].Deadline = &d
		}
	}
	if s.Policy != nil {
		c.Policy = s.Policy.DeepCopy()
	}
	return &c
}
