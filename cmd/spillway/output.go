package main

import (
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"

	"github.com/spillway-dev/spillway/internal/sim"
)

// writeJSON prints the report as one indented JSON object.
func writeJSON(w io.Writer, rep *sim.Report) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(rep); err != nil {
		return fmt.Errorf("failed to write JSON: %w", err)
	}
	return nil
}

// writeTable prints a header about the scenario and one row per policy.
func writeTable(w io.Writer, sc *sim.Scenario, rep *sim.Report) error {
	fmt.Fprintf(w, "scenario %s (seed %d): outage %v at %v, horizon %v\n",
		rep.Scenario, seedOf(sc), sc.Timeline.Outage.Duration, sc.T0(), sc.Timeline.Horizon.Duration)
	if len(rep.Policies) > 0 {
		b := rep.Policies[len(rep.Policies)-1].Recovery
		fmt.Fprintf(w, "backlog at recovery: %d pending, %d past deadline, %d superseded, %d useful\n",
			b.Pending, b.PastDeadline, b.Superseded, b.Useful)
	}
	width := len("policy")
	for _, r := range rep.Policies {
		width = max(width, len(r.Policy))
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "%-*s\tpeak/cap\t2nd outages\tdrain s\tpredicted s\tcompleted\tstale\tsuperseded\tparked\tgave up\tpending\tlost\tcalls\tamplif.\t\n", width, "policy")
	for _, r := range rep.Policies {
		fmt.Fprintf(tw, "%-*s\t%.2f\t%d\t%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%.2f\t\n",
			width, r.Policy, r.PeakOverCapacity, r.SecondOutages, seconds(r.DrainSeconds), forecast(r.Prediction),
			r.Completed, r.Stale, r.Superseded, r.Parked, r.GaveUp, r.Pending, r.Lost, r.Calls, r.Amplification)
	}
	if err := tw.Flush(); err != nil {
		return fmt.Errorf("failed to write table: %w", err)
	}
	return nil
}

func seedOf(sc *sim.Scenario) uint64 {
	if sc.Seed == 0 {
		return 1
	}
	return sc.Seed
}

// forecast formats the drain forecast: "≥N" when it is a lower bound (the
// ramp found the dependency serving less than its policy says), "-" when
// there is none.
func forecast(p sim.Prediction) string {
	switch {
	case p.Seconds == nil:
		return "-"
	case p.AtLeast:
		return "≥" + seconds(p.Seconds)
	case p.From != nil:
		return seconds(p.From) + "–" + seconds(p.Seconds)
	}
	return seconds(p.Seconds)
}

// seconds formats an optional number of seconds; nil is "never".
func seconds(v *float64) string {
	if v == nil {
		return "never"
	}
	return strconv.FormatFloat(*v, 'f', 0, 64)
}
