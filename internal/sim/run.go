package sim

import (
	"fmt"
	"runtime"
	"sync"

	"github.com/spillway-dev/spillway/internal/policy"
)

// Report is the outcome of every policy on one scenario. Its JSON form is
// the output of `spillway simulate --json`.
type Report struct {
	// Scenario is the scenario's name.
	Scenario string `json:"scenario"`
	// Policies holds one result per policy, in the order asked for.
	Policies []Result `json:"policies"`
}

// Run replays sc once per policy (all of them when policies is empty) and
// returns the results in the order of policies. It does not modify sc. Runs
// are independent and deterministic: each draws from its own generators
// seeded by sc.Seed, so the report depends only on sc and policies. They run
// in parallel, one per CPU.
func Run(sc *Scenario, policies []Policy) (*Report, error) {
	c := sc.Clone()
	c.Default()
	if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("invalid scenario %q: %w", c.Name, err)
	}
	params, err := policy.FromSpec(c.Policy.Spec)
	if err != nil {
		return nil, fmt.Errorf("invalid policy of scenario %q: %w", c.Name, err)
	}
	if len(policies) == 0 {
		policies = Policies()
	}
	for _, p := range policies {
		if !p.valid() {
			return nil, fmt.Errorf("unknown policy %q", p)
		}
	}
	results := make([]Result, len(policies))
	var pool bufferPool
	var wg sync.WaitGroup
	sem := make(chan struct{}, runtime.GOMAXPROCS(0))
	for i, p := range policies {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			results[i] = simulate(c, params, p, &pool)
		}()
	}
	wg.Wait()
	return &Report{Scenario: c.Name, Policies: results}, nil
}

// buffers are the large arrays of a run: its job table and the blocks of
// its ready queue and retry timers.
type buffers struct {
	jobs   *jobTable
	ready  []*fifoBlock
	timers []*timerBlock
}

// bufferPool hands the buffers of a finished run to the next run of the
// same scenario: a report then fills only as many as it runs at once, and
// reuses their memory instead of asking the system for fresh pages for
// every policy (the largest cost of a fleet-scale run after the events).
type bufferPool struct {
	mu   sync.Mutex
	free []buffers
}

// get returns buffers to reuse; they are empty when none are free.
func (p *bufferPool) get() buffers {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.free) == 0 {
		return buffers{}
	}
	b := p.free[len(p.free)-1]
	p.free = p.free[:len(p.free)-1]
	return b
}

func (p *bufferPool) put(b buffers) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.free = append(p.free, b)
}
