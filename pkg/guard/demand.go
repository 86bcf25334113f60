package guard

// demandIntervals is how many refresh intervals a batching process's demand
// is remembered: its pool keeps the most slots it used at once in any of
// them, so a dip between two bursts does not hand slots back only to take
// them again one refresh later, and slots left idle for that long go back.
const demandIntervals = 3

// demand estimates what a batching process could use (Options.Batch): the
// slots it would hold and the rate tokens it would spend before its next
// refresh. It is measured per refresh interval: the most calls it had
// running or waiting at once, plus the calls it refused for want of a slot
// (they would have run), and the calls it started, plus those refused for
// want of a rate token. Not safe for concurrent use: the pool's lock guards
// it.
type demand struct {
	peak, refused      int64 // this interval: slots
	starts, rateRefuse int64 // this interval: rate tokens
	calls              int64 // this interval: calls of any kind
	slots, tokens      [demandIntervals]int64
	busy               [demandIntervals]bool
	next               int
}

// touch records a call, whatever becomes of it: a process that calls is
// not idle, even when every call is refused locally (Open).
func (d *demand) touch() { d.calls++ }

// observe records active calls (running plus waiting) now.
func (d *demand) observe(active int64) { d.peak = max(d.peak, active) }

// refuse records a call refused for want of a slot (rate false) or of a
// rate token (rate true).
func (d *demand) refuse(rate bool) {
	if rate {
		d.rateRefuse++
	} else {
		d.refused++
	}
}

// start records a call started on a rate token.
func (d *demand) start() { d.starts++ }

// current is this interval's slot demand so far.
func (d *demand) current() int64 { return d.peak + d.refused }

// roll closes the interval, with active calls now, and returns the slots
// and rate tokens to ask for: the most of the remembered intervals.
func (d *demand) roll(active int64) (slots, tokens int64) {
	d.slots[d.next] = d.peak + d.refused
	d.tokens[d.next] = d.starts + d.rateRefuse
	d.busy[d.next] = d.calls > 0
	d.next = (d.next + 1) % demandIntervals
	d.peak, d.refused, d.starts, d.rateRefuse, d.calls = active, 0, 0, 0, 0
	for i := range demandIntervals {
		slots, tokens = max(slots, d.slots[i]), max(tokens, d.tokens[i])
	}
	return max(slots, active), tokens
}

// idle reports whether no demand is remembered: the pool may stop
// refreshing.
func (d *demand) idle() bool {
	if d.peak+d.refused+d.starts+d.rateRefuse+d.calls > 0 {
		return false
	}
	for i := range demandIntervals {
		if d.slots[i]+d.tokens[i] > 0 || d.busy[i] {
			return false
		}
	}
	return true
}
