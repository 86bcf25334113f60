package main

import (
	"image"
	"image/color"
	"image/png"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spillway-dev/spillway/internal/replay"
)

// demoResults are two replays shaped like the demo's: the protected fleet's
// breaker opens in the outage and ramps back; the other fleet's retries fail
// by thousands a second and it never drains.
func demoResults(cfg replay.Config) []replay.Result {
	var protected, naive replay.Result
	protected.Protected = true
	outageFrom, outageTo := cfg.Warm, cfg.Warm+cfg.Outage
	for at := cfg.SampleEvery; at <= 13*time.Second; at += cfg.SampleEvery {
		p := replay.Sample{At: at, State: "Closed", Limit: 10, ServedPerSec: 80}
		n := replay.Sample{At: at, ServedPerSec: 80}
		switch {
		case at > outageFrom && at <= outageTo:
			p.State, p.Limit, p.ServedPerSec, p.FailedPerSec = "Open", 0, 0, 0
			n.ServedPerSec, n.FailedPerSec = 0, 5000
		case at > outageTo && at <= outageTo+2*time.Second:
			p.State, p.Limit, p.ServedPerSec = "Ramping", 2, 40
			n.ServedPerSec, n.FailedPerSec = 24, 6000
		case at > outageTo:
			p.ServedPerSec = 200
			n.ServedPerSec, n.FailedPerSec = 0, 5500
		}
		if at == outageFrom+cfg.SampleEvery {
			p.FailedPerSec = 192 // the calls that failed before the breaker opened
		}
		protected.Samples = append(protected.Samples, p)
		naive.Samples = append(naive.Samples, n)
	}
	return []replay.Result{protected, naive}
}

func seriesNamed(t *testing.T, p replayPanel, prefix string) replaySeries {
	t.Helper()
	for _, s := range p.series {
		if strings.HasPrefix(s.name, prefix) {
			return s
		}
	}
	t.Fatalf("panel %q has no series %q", p.title, prefix)
	return replaySeries{}
}

func TestReplayPanelsSplitSuccessesFromFailuresOverTheOutage(t *testing.T) {
	cfg := replay.DefaultConfig()
	results := demoResults(cfg)
	panels := replayPanels(cfg, results)
	if len(panels) != len(results) {
		t.Fatalf("%d panels for %d fleets", len(panels), len(results))
	}
	for i, p := range panels {
		r := results[i]
		if p.outageFrom != cfg.Warm.Seconds() || p.outageTo != (cfg.Warm+cfg.Outage).Seconds() {
			t.Errorf("%s: outage shaded from %g to %g s, want %g to %g", p.title, p.outageFrom, p.outageTo, cfg.Warm.Seconds(), (cfg.Warm + cfg.Outage).Seconds())
		}
		served, failed := seriesNamed(t, p, "calls that succeeded"), seriesNamed(t, p, "calls that failed")
		if served.color == failed.color {
			t.Errorf("%s: successes and failures share a colour", p.title)
		}
		for j, s := range r.Samples {
			if got, want := served.pts[j].Y, max(s.ServedPerSec, logFloor); got != want {
				t.Errorf("%s: successes at %v = %g, want %g", p.title, s.At, got, want)
			}
			if got, want := failed.pts[j].Y, max(s.FailedPerSec, logFloor); got != want {
				t.Errorf("%s: failures at %v = %g, want %g", p.title, s.At, got, want)
			}
		}
		capacity := seriesNamed(t, p, "dependency's throughput at capacity")
		if capacity.pts[0].Y != 200 { // 10 calls at once, 50 ms each
			t.Errorf("%s: capacity line at %g calls/s, want 200", p.title, capacity.pts[0].Y)
		}
		hasLimit := slices.ContainsFunc(p.series, func(s replaySeries) bool { return strings.Contains(s.name, "limit") })
		if hasLimit != r.Protected {
			t.Errorf("%s: limit line drawn = %v, want %v (only Spillway publishes a limit)", p.title, hasLimit, r.Protected)
		}
		if p.yMax <= 6000 { // the naive fleet's failures
			t.Errorf("%s: y axis ends at %g, below the highest line", p.title, p.yMax)
		}
	}
	if panels[0].yMax != panels[1].yMax || panels[0].xMax != panels[1].xMax {
		t.Errorf("panels do not share their axes: %g/%g s, %g/%g calls/s", panels[0].xMax, panels[1].xMax, panels[0].yMax, panels[1].yMax)
	}
	limit := seriesNamed(t, panels[0], "Spillway's limit")
	if !limit.step {
		t.Error("the limit is not drawn as steps")
	}
	var levels []float64
	for _, pt := range limit.pts {
		if len(levels) == 0 || levels[len(levels)-1] != pt.Y {
			levels = append(levels, pt.Y)
		}
	}
	// limit 10, 0 (drawn at 1), 2, 10 calls in flight of 50 ms each.
	if want := []float64{200, 1, 40, 200}; !slices.Equal(levels, want) {
		t.Errorf("limit levels = %v calls/s, want %v", levels, want)
	}
}

// TestPlotReplayShadesTheOutage renders the PNG and counts the pixels of
// each colour: the shading must cover a wide band in both panels (the legend
// swatch alone is a few hundred pixels), and the lines must be drawn.
func TestPlotReplayShadesTheOutage(t *testing.T) {
	cfg := replay.DefaultConfig()
	file := filepath.Join(t.TempDir(), "demo.png")
	if err := plotReplay(file, cfg, demoResults(cfg)); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatalf("not a PNG: %v", err)
	}
	b := img.Bounds()
	count := map[color.RGBA]int{}
	// shadedRows counts, per half of the image (one panel each), the rows
	// with a long run of the outage's grey.
	shadedRows := [2]int{}
	for y := b.Min.Y; y < b.Max.Y; y++ {
		run, longest := 0, 0
		for x := b.Min.X; x < b.Max.X; x++ {
			c := rgba(img, x, y)
			count[c]++
			if c == colorOutage {
				run++
				longest = max(longest, run)
			} else {
				run = 0
			}
		}
		if longest > b.Dx()/20 {
			shadedRows[min(2*(y-b.Min.Y)/b.Dy(), 1)]++
		}
	}
	for i, rows := range shadedRows {
		if rows < b.Dy()/6 {
			t.Errorf("panel %d: %d of %d rows shaded, want the outage shaded over the panel's data area", i+1, rows, b.Dy()/2)
		}
	}
	for name, c := range map[string]color.RGBA{"successes": colorServed, "failures": colorFailed, "limit": colorLimit} {
		if count[c] < 300 {
			t.Errorf("%d pixels of the %s' colour, want a line's worth", count[c], name)
		}
	}
}

func rgba(img image.Image, x, y int) color.RGBA {
	r, g, b, a := img.At(x, y).RGBA()
	return color.RGBA{R: uint8(r >> 8), G: uint8(g >> 8), B: uint8(b >> 8), A: uint8(a >> 8)}
}
