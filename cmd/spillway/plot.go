package main

import (
	"fmt"
	"image/color"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"

	"github.com/spillway-dev/spillway/internal/sim"
)

// palette gives each policy a colour, from warm (naive) to cool (Spillway).
var palette = []color.RGBA{
	{R: 0xd6, G: 0x27, B: 0x28, A: 0xff},
	{R: 0xff, G: 0x7f, B: 0x0e, A: 0xff},
	{R: 0xbc, G: 0xbd, B: 0x22, A: 0xff},
	{R: 0x8c, G: 0x56, B: 0x4b, A: 0xff},
	{R: 0xe3, G: 0x77, B: 0xc2, A: 0xff},
	{R: 0x94, G: 0x67, B: 0xbd, A: 0xff},
	{R: 0x17, G: 0xbe, B: 0xcf, A: 0xff},
	{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff},
}

// writePlot draws the calls started at the dependency per second for every
// policy against its capacity, with time in minutes from the recovery, like
// the seeds' "waves vs spread" and "slow start" figures.
func writePlot(file string, sc *sim.Scenario, rep *sim.Report) error {
	p := plot.New()
	p.Title.Text = fmt.Sprintf("%s: calls to the dependency per second", rep.Scenario)
	p.X.Label.Text = "minutes from recovery (outage before 0)"
	p.Y.Label.Text = "calls started per second"
	p.Legend.Top = true
	t1 := sc.T1().Seconds()
	for _, r := range rep.Policies {
		line, err := plotter.NewLine(callSeries(r.Series.Calls, t1))
		if err != nil {
			return fmt.Errorf("failed to plot %s: %w", r.Policy, err)
		}
		line.Color = colorOf(r.Policy)
		line.Width = vg.Points(1)
		if r.Policy == sim.Spillway {
			line.Width = vg.Points(2)
		}
		p.Add(line)
		p.Legend.Add(string(r.Policy), line)
	}
	capacity, err := capacityLine(sc, t1)
	if err != nil {
		return err
	}
	p.Add(capacity)
	p.Legend.Add("capacity", capacity)
	if err := p.Save(12*vg.Inch, 6*vg.Inch, file); err != nil {
		return fmt.Errorf("failed to write plot: %w", err)
	}
	return nil
}

// colorOf gives a policy the same colour whichever policies are drawn.
func colorOf(p sim.Policy) color.Color {
	for i, known := range sim.Policies() {
		if p == known {
			return palette[i%len(palette)]
		}
	}
	return color.Gray{Y: 0x80}
}

// callSeries turns per-second counts into points, x in minutes from t1.
func callSeries(calls []int32, t1 float64) plotter.XYs {
	pts := make(plotter.XYs, len(calls))
	for i, c := range calls {
		pts[i].X = (float64(i) - t1) / 60
		pts[i].Y = float64(c)
	}
	return pts
}

// capacityLine is the dependency's nominal throughput, dashed.
func capacityLine(sc *sim.Scenario, t1 float64) (*plotter.Line, error) {
	capacity := float64(sc.Dependency.Concurrency) / sc.Dependency.CallDuration.Seconds()
	end := (sc.Timeline.Horizon.Duration.Seconds() - t1) / 60
	line, err := plotter.NewLine(plotter.XYs{{X: -t1 / 60, Y: capacity}, {X: end, Y: capacity}})
	if err != nil {
		return nil, fmt.Errorf("failed to plot capacity: %w", err)
	}
	line.Color = color.Black
	line.Width = vg.Points(1.5)
	line.Dashes = []vg.Length{vg.Points(6), vg.Points(4)}
	return line, nil
}
