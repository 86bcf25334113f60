package status

import (
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

// Output formats.
const (
	// OutputTable is the default: one line per policy.
	OutputTable = ""
	// OutputWide adds the published state, the consumers' names and the
	// Ready condition's message.
	OutputWide = "wide"
	// OutputJSON and OutputYAML print a Report.
	OutputJSON = "json"
	OutputYAML = "yaml"
)

// Cells shown in place of a Redis figure.
const (
	// cellUnknown: Redis could not be read.
	cellUnknown = "?"
	// cellNone: nothing to show (not published, no calls, not ramping).
	cellNone = "-"
)

// Report is everything one `spillway status` read: the -o json and -o yaml
// output.
type Report struct {
	// Time is when the report was read.
	Time metav1.Time `json:"time"`
	// Items are the policies, by namespace and name.
	Items []Row `json:"items"`
	// RedisUnreachable is why Redis could not be read, for every policy;
	// empty when it answered.
	RedisUnreachable string `json:"redisUnreachable,omitempty"`
}

// Write prints r in format (OutputTable, OutputWide, OutputJSON or
// OutputYAML); allNamespaces adds the NAMESPACE column to a table.
func Write(w io.Writer, r Report, format string, allNamespaces bool) error {
	switch format {
	case OutputTable, OutputWide:
		return writeTable(w, r, format == OutputWide, allNamespaces)
	case OutputJSON:
		b, err := json.MarshalIndent(r, "", "  ")
		if err != nil {
			return fmt.Errorf("failed to encode the report as JSON: %w", err)
		}
		_, err = fmt.Fprintf(w, "%s\n", b)
		return err
	case OutputYAML:
		b, err := yaml.Marshal(r)
		if err != nil {
			return fmt.Errorf("failed to encode the report as YAML: %w", err)
		}
		_, err = w.Write(b)
		return err
	}
	return fmt.Errorf("unknown output format %q: use wide, json or yaml", format)
}

// writeTable prints one line per policy, and under the table why Redis
// could not be read, if it could not.
func writeTable(w io.Writer, r Report, wide, allNamespaces bool) error {
	if len(r.Items) == 0 {
		_, err := fmt.Fprintln(w, "No DependencyPolicies found.")
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 0, 3, ' ', 0)
	header := []string{"NAME", "STATE", "LIMIT/CAPACITY", "RAMP", "IN FLIGHT", "CALLS/s", "FAIL%", "RETRY%", "PROTOCOLS", "CONSUMERS", "AGE", "REASON"}
	if wide {
		header = append(header, "PUBLISHED", "WORKERS", "MESSAGE")
	}
	if allNamespaces {
		header = append([]string{"NAMESPACE"}, header...)
	}
	fmt.Fprintln(tw, strings.Join(header, "\t"))
	now := r.Time.Time
	for _, row := range r.Items {
		cells := tableCells(row, now, wide)
		if allNamespaces {
			cells = append([]string{row.Namespace}, cells...)
		}
		fmt.Fprintln(tw, strings.Join(cells, "\t"))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if r.RedisUnreachable != "" {
		_, err := fmt.Fprintf(w, "Redis was unreachable, so IN FLIGHT, CALLS/s, FAIL%% and RETRY%% are unknown (%s): %s\n", cellUnknown, r.RedisUnreachable)
		return err
	}
	return nil
}

// tableCells are row's cells, in the header's order.
func tableCells(row Row, now time.Time, wide bool) []string {
	inFlight, calls, fail, retry := redisCells(row)
	cells := []string{
		row.Name,
		orNone(row.State),
		fmt.Sprintf("%d/%d", row.Limit, row.Capacity),
		rampCell(row.Ramp),
		inFlight, calls, fail, retry,
		protocolsCell(row),
		consumersCell(row.Consumers, wide),
		Age(row.LastTransitionTime, now),
		reasonCell(row),
	}
	if wide {
		cells = append(cells, publishedCell(row, now), workersCell(row), messageCell(row))
	}
	return cells
}

// redisCells are IN FLIGHT, CALLS/s, FAIL% and RETRY%.
func redisCells(row Row) (inFlight, calls, fail, retry string) {
	r := row.Redis
	switch {
	case r == nil:
		return cellUnknown, cellUnknown, cellUnknown, cellUnknown
	case !r.Published:
		return cellNone, cellNone, cellNone, cellNone
	}
	inFlight = strconv.FormatInt(r.InFlight, 10)
	calls = strconv.FormatFloat(r.CallsPerSecond(), 'f', 1, 64)
	fail, retry = cellNone, cellNone
	if p, ok := r.FailurePercent(); ok {
		fail = strconv.FormatFloat(p, 'f', 1, 64) + "%"
	}
	if p, ok := r.RetryPercent(); ok {
		retry = strconv.FormatFloat(p, 'f', 1, 64) + "%"
	}
	return inFlight, calls, fail, retry
}

// protocolsCell is the protocol versions the workers spoke in the last
// minute, newest first ("5,4"): "-" when none, "?" when they could not be
// read.
func protocolsCell(row Row) string {
	switch {
	case row.Redis == nil || row.Redis.Workers == "":
		return cellUnknown
	case len(row.Redis.Protocols) == 0:
		return cellNone
	}
	vs := make([]string, len(row.Redis.Protocols))
	for i, v := range row.Redis.Protocols {
		vs[i] = strconv.Itoa(v)
	}
	return strings.Join(vs, ",")
}

// workersCell is the processes per protocol version and client.
func workersCell(row Row) string {
	if row.Redis == nil || row.Redis.Workers == "" {
		return cellUnknown
	}
	return row.Redis.Workers
}

// rampCell is "step/steps", with the ceiling a step back left.
func rampCell(r *Ramp) string {
	if r == nil {
		return cellNone
	}
	s := fmt.Sprintf("%d/%d", r.Step, r.Steps)
	if r.Ceiling > 0 {
		s += fmt.Sprintf(" ceiling %d", r.Ceiling)
	}
	return s
}

// consumersCell is each consumer's bounded max and pinned min ("max 20 min
// 6"), or why it is not bound; wide names them.
func consumersCell(cs []Consumer, wide bool) string {
	if len(cs) == 0 {
		return cellNone
	}
	parts := make([]string, 0, len(cs))
	for _, c := range cs {
		var s string
		switch {
		case c.Bound && c.Workload:
			s = fmt.Sprintf("replicas %d", deref(c.MaxReplicas))
		case c.Bound:
			s = fmt.Sprintf("max %d", deref(c.MaxReplicas))
			if c.PinnedMinReplicas != nil {
				s += fmt.Sprintf(" min %d", *c.PinnedMinReplicas)
			}
		case wide:
			s = c.Problem
		default:
			s = "unbound"
		}
		if wide {
			s = kindAbbrev(c.Kind) + "/" + c.Name + " " + s
		}
		parts = append(parts, s)
	}
	return strings.Join(parts, ", ")
}

// kindAbbrev is kubectl's short name of an autoscaler kind.
func kindAbbrev(kind string) string {
	switch kind {
	case "ScaledObject":
		return "so"
	case "HorizontalPodAutoscaler":
		return "hpa"
	case "Deployment":
		return "deploy"
	case "StatefulSet":
		return "sts"
	case "ReplicaSet":
		return "rs"
	}
	return strings.ToLower(kind)
}

// reasonCell is the reason of the row's Explanation.
func reasonCell(row Row) string {
	if c := row.Explanation(); c != nil && c.Reason != "" {
		return c.Reason
	}
	return cellNone
}

// messageCell is the message of the row's Explanation.
func messageCell(row Row) string {
	if c := row.Explanation(); c != nil && c.Message != "" {
		return c.Message
	}
	return cellNone
}

// publishedCell is the state and limit in Redis, their epoch and how long
// ago they were published.
func publishedCell(row Row, now time.Time) string {
	r := row.Redis
	switch {
	case r == nil:
		return cellUnknown
	case !r.Published:
		return "not published"
	}
	return fmt.Sprintf("%s %d epoch %d, %s ago", r.State, r.Limit, r.Epoch, Age(r.UpdatedAt, now))
}

func orNone(s string) string {
	if s == "" {
		return cellNone
	}
	return s
}

func deref(p *int32) int32 {
	if p == nil {
		return 0
	}
	return *p
}
