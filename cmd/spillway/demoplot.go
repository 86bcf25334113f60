package main

import (
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"

	"github.com/spillway-dev/spillway/internal/replay"
)

// The demo plot's colours: what succeeded, what failed, the limit Spillway
// published, the dependency's capacity, and the outage behind them.
var (
	colorServed   = color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff} // green
	colorFailed   = color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff} // red
	colorLimit    = color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff} // blue
	colorCapacity = color.Black
	colorOutage   = color.RGBA{R: 0xdd, G: 0xdd, B: 0xdd, A: 0xff} // light grey
)

// replaySeries is one line of a demo panel.
type replaySeries struct {
	name   string
	color  color.Color
	width  vg.Length
	dashes []vg.Length
	step   bool // a level held until the next sample (the limit)
	pts    plotter.XYs
}

// replayPanel is one fleet's panel: its calls per second, split into those
// that succeeded and those that failed, over the shaded outage.
type replayPanel struct {
	title                string
	outageFrom, outageTo float64 // seconds from the start
	xMax, yMax           float64
	series               []replaySeries
}

// logFloor is where a quiet second sits on the log scale.
const logFloor = 1

// replayPanels describes the demo plot, one panel per fleet, on shared axes.
func replayPanels(cfg replay.Config, results []replay.Result) []replayPanel {
	throughput := float64(cfg.Dependency.Capacity) / cfg.Dependency.ServiceTime.Seconds()
	xMax, yMax := (cfg.Warm + cfg.Outage).Seconds(), throughput
	for _, r := range results {
		for _, s := range r.Samples {
			xMax = max(xMax, s.At.Seconds())
			yMax = max(yMax, s.ServedPerSec, s.FailedPerSec)
		}
	}
	// Up to the next power of ten, so the top tick is labelled.
	yMax = math.Pow(10, math.Ceil(math.Log10(yMax*1.2)))

	panels := make([]replayPanel, 0, len(results))
	for _, r := range results {
		served := make(plotter.XYs, len(r.Samples))
		failed := make(plotter.XYs, len(r.Samples))
		for i, s := range r.Samples {
			served[i] = plotter.XY{X: s.At.Seconds(), Y: max(s.ServedPerSec, logFloor)}
			failed[i] = plotter.XY{X: s.At.Seconds(), Y: max(s.FailedPerSec, logFloor)}
		}
		p := replayPanel{
			title:      "without Spillway: immediate retries, autoscaler unbounded",
			outageFrom: cfg.Warm.Seconds(),
			outageTo:   (cfg.Warm + cfg.Outage).Seconds(),
			xMax:       xMax,
			yMax:       yMax,
		}
		if r.Protected {
			p.title = "with Spillway: breaker, ramp and bounded autoscaler"
		}
		p.series = append(p.series,
			replaySeries{name: "calls that succeeded /s", color: colorServed, width: vg.Points(2), pts: served},
			replaySeries{name: "calls that failed /s", color: colorFailed, width: vg.Points(1.5), pts: failed},
		)
		if r.Protected {
			// The limit is a number of calls in flight; at the dependency's
			// service time it admits limit/serviceTime calls per second, on
			// the same axis as the calls.
			limit := make(plotter.XYs, 0, len(r.Samples))
			for _, s := range r.Samples {
				if s.State == "" {
					continue // nothing published yet
				}
				limit = append(limit, plotter.XY{X: s.At.Seconds(), Y: max(float64(s.Limit)/cfg.Dependency.ServiceTime.Seconds(), logFloor)})
			}
			if len(limit) > 0 {
				p.series = append(p.series, replaySeries{name: fmt.Sprintf("Spillway's limit, as calls/s (limit / %v)", cfg.Dependency.ServiceTime), color: colorLimit, width: vg.Points(1.5), step: true, pts: limit})
			}
		}
		p.series = append(p.series, replaySeries{
			name: "dependency's throughput at capacity", color: colorCapacity, width: vg.Points(1),
			dashes: []vg.Length{vg.Points(6), vg.Points(4)},
			pts:    plotter.XYs{{X: 0, Y: throughput}, {X: xMax, Y: throughput}},
		})
		panels = append(panels, p)
	}
	return panels
}

// plot draws the panel.
func (rp replayPanel) plot() (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = rp.title
	p.X.Label.Text = fmt.Sprintf("seconds from the start (outage from %g s to %g s, shaded)", rp.outageFrom, rp.outageTo)
	p.Y.Label.Text = "calls per second (log; 0 drawn at 1)"
	p.Y.Scale = plot.LogScale{}
	p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
	p.X.Min, p.X.Max = 0, rp.xMax
	p.Y.Min, p.Y.Max = logFloor, rp.yMax
	p.Legend.Top = true
	p.Legend.Left = true
	p.Legend.ThumbnailWidth = vg.Points(24)

	outage, err := plotter.NewPolygon(plotter.XYs{
		{X: rp.outageFrom, Y: logFloor}, {X: rp.outageTo, Y: logFloor},
		{X: rp.outageTo, Y: rp.yMax}, {X: rp.outageFrom, Y: rp.yMax},
	})
	if err != nil {
		return nil, fmt.Errorf("failed to plot the outage: %w", err)
	}
	outage.Color = colorOutage
	outage.LineStyle.Width = 0
	p.Add(outage)
	p.Legend.Add("outage", outage)

	for _, s := range rp.series {
		line, err := plotter.NewLine(s.pts)
		if err != nil {
			return nil, fmt.Errorf("failed to plot %s: %w", s.name, err)
		}
		line.Color = s.color
		line.Width = s.width
		line.Dashes = s.dashes
		if s.step {
			line.StepStyle = plotter.PostStep
		}
		p.Add(line)
		p.Legend.Add(s.name, line)
	}
	return p, nil
}

// plotReplay writes the demo plot: one panel per fleet, stacked, on the same
// axes, so the protected fleet's calls can be read against the other's.
func plotReplay(file string, cfg replay.Config, results []replay.Result) error {
	panels := replayPanels(cfg, results)
	if len(panels) == 0 {
		return fmt.Errorf("failed to write plot: no replay to draw")
	}
	rows := make([][]*plot.Plot, len(panels))
	for i, rp := range panels {
		p, err := rp.plot()
		if err != nil {
			return err
		}
		rows[i] = []*plot.Plot{p}
	}
	format := strings.TrimPrefix(strings.ToLower(filepath.Ext(file)), ".")
	img, err := draw.NewFormattedCanvas(11*vg.Inch, vg.Length(4.2*float64(len(panels)))*vg.Inch, format)
	if err != nil {
		return fmt.Errorf("failed to write plot %s: %w", file, err)
	}
	tiles := draw.Tiles{Rows: len(panels), Cols: 1, PadTop: vg.Points(4), PadBottom: vg.Points(4), PadLeft: vg.Points(4), PadRight: vg.Points(12), PadY: vg.Points(14)}
	canvases := plot.Align(rows, tiles, draw.New(img))
	for i := range rows {
		rows[i][0].Draw(canvases[i][0])
	}
	f, err := os.Create(file)
	if err != nil {
		return fmt.Errorf("failed to write plot: %w", err)
	}
	if _, err := img.WriteTo(f); err != nil {
		_ = f.Close()
		return fmt.Errorf("failed to write plot: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("failed to write plot: %w", err)
	}
	return nil
}
