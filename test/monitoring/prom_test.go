package monitoring

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"time"
)

// series is one series of a range query's answer: its labels and the times
// of its samples.
type series struct {
	Metric map[string]string
	Times  []time.Time
}

// queryRange runs a PromQL range query against the Prometheus at base, one
// step a second, and returns its series. A query Prometheus refuses (a
// syntax error, a bad function) is an error.
func queryRange(base, query string, start, end time.Time) ([]series, error) {
	v := url.Values{
		"query": {query},
		"start": {strconv.FormatFloat(float64(start.UnixMilli())/1000, 'f', 3, 64)},
		"end":   {strconv.FormatFloat(float64(end.UnixMilli())/1000, 'f', 3, 64)},
		"step":  {"1"},
	}
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get(base + "/api/v1/query_range?" + v.Encode())
	if err != nil {
		return nil, fmt.Errorf("query %q: %w", query, err)
	}
	defer resp.Body.Close()
	var body struct {
		Status string `json:"status"`
		Error  string `json:"error"`
		Data   struct {
			Result []struct {
				Metric map[string]string `json:"metric"`
				Values [][2]any          `json:"values"`
			} `json:"result"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return nil, fmt.Errorf("query %q: decode the answer (%s): %w", query, resp.Status, err)
	}
	if body.Status != "success" {
		return nil, fmt.Errorf("query %q: %s", query, body.Error)
	}
	out := make([]series, 0, len(body.Data.Result))
	for _, r := range body.Data.Result {
		s := series{Metric: r.Metric}
		for _, v := range r.Values {
			ts, ok := v[0].(float64)
			if !ok {
				return nil, fmt.Errorf("query %q: unexpected sample %v", query, v)
			}
			s.Times = append(s.Times, time.UnixMilli(int64(ts*1000)))
		}
		out = append(out, s)
	}
	return out, nil
}

// firing returns the intervals during which an alert with the expression
// that answered ss would fire, its "for" being hold: each run of samples one
// step apart fires from hold after its start to its end.
func firing(ss []series, hold time.Duration) [][2]time.Time {
	const gap = 1500 * time.Millisecond // the query's step is 1 s
	var out [][2]time.Time
	for _, s := range ss {
		for i := 0; i < len(s.Times); {
			j := i
			for j+1 < len(s.Times) && s.Times[j+1].Sub(s.Times[j]) <= gap {
				j++
			}
			if from := s.Times[i].Add(hold); !from.After(s.Times[j]) {
				out = append(out, [2]time.Time{from, s.Times[j]})
			}
			i = j + 1
		}
	}
	return out
}

// overlapping returns the intervals of iv that overlap [from, to], counted
// from begin.
func overlapping(iv [][2]time.Time, from, to, begin time.Time) [][2]time.Duration {
	var out [][2]time.Duration
	for _, w := range iv {
		if !w[1].Before(from) && !w[0].After(to) {
			out = append(out, [2]time.Duration{w[0].Sub(begin).Round(time.Second), w[1].Sub(begin).Round(time.Second)})
		}
	}
	return out
}

// labelValues runs Grafana's label_values(match, label) against the
// Prometheus at base: the values of label on the series match selects
// between start and end.
func labelValues(base, label, match string, start, end time.Time) ([]string, error) {
	v := url.Values{
		"match[]": {match},
		"start":   {strconv.FormatInt(start.Unix(), 10)},
		"end":     {strconv.FormatInt(end.Unix()+1, 10)},
	}
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get(base + "/api/v1/label/" + url.PathEscape(label) + "/values?" + v.Encode())
	if err != nil {
		return nil, fmt.Errorf("label values of %s for %s: %w", label, match, err)
	}
	defer resp.Body.Close()
	var body struct {
		Status string   `json:"status"`
		Error  string   `json:"error"`
		Data   []string `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return nil, fmt.Errorf("label values of %s for %s: decode the answer (%s): %w", label, match, resp.Status, err)
	}
	if body.Status != "success" {
		return nil, fmt.Errorf("label values of %s for %s: %s", label, match, body.Error)
	}
	return body.Data, nil
}
