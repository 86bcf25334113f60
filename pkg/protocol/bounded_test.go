package protocol_test

import (
	"bufio"
	"fmt"
	"math/rand/v2"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/redistest"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// The tests of this file check that no script's work grows with the size of
// the stats hash or, after a transition, with the window's length. They do
// not time the scripts (the machine is shared and noisy): they count the hash
// fields each script names or visits, read from MONITOR on a server of their
// own. docs/benchmarks.md has what a field costs in microseconds; at that
// cost, maxFieldsPerScript fields stay well under 5 ms of Redis time.
const maxFieldsPerScript = 2000

// maxColdHourWindowFields bounds the fields a cold read of a 1 h window
// (window.lua, 11 counters a second) names, wherever in the minute it runs.
// The sum reads the seconds of the two partial minutes at the ends of the
// range (59 together), and the 60 seconds of minute 'seen' when the read
// runs in a later minute before any report rolled 'seen' up (keep_stats
// runs with the first report of a minute, never with a read), and the
// minute totals of the 58 whole minutes left: (59 + 60 + 58) × 11 = 1,947.
// Around it: the cache's HMGET (5 fields, 11 totals, the current second's
// 11), its HSET (2 + 11), HSETNX encoding, and one prune step (HMGET of 4,
// HDEL of at most 16 seconds and one minute's totals, 17 × 11, HSET 1):
// 27 + 13 + 1 + 192. So 2,180: a read at hh:mm:58 whose next reads cross
// the minute names 2,015 (its prune deletes one second and one minute's
// totals), which maxFieldsPerScript refused.
const maxColdHourWindowFields = (59+60+58)*11 + (5 + 2*11) + (2 + 11) + 1 + (4 + 17*11 + 1)

// luaCommand is one command a script ran, as MONITOR reports it.
type luaCommand struct {
	name string   // lower case, e.g. "hmget"
	args []string // the key first
}

// scriptMonitor reads MONITOR on a connection of its own.
type scriptMonitor struct {
	r   *bufio.Reader
	c   net.Conn
	rdb *redis.Client
	seq int
}

func startMonitor(t *testing.T, srv *redistest.Server) *scriptMonitor {
	t.Helper()
	conn, err := net.Dial("tcp", srv.Addr())
	if err != nil {
		t.Fatalf("dial for MONITOR: %v", err)
	}
	t.Cleanup(func() { conn.Close() })
	m := &scriptMonitor{r: bufio.NewReader(conn), c: conn, rdb: srv.Client()}
	if _, err := conn.Write([]byte("MONITOR\r\n")); err != nil {
		t.Fatalf("MONITOR: %v", err)
	}
	if line, err := m.r.ReadString('\n'); err != nil || !strings.HasPrefix(line, "+OK") {
		t.Fatalf("MONITOR = %q, %v", line, err)
	}
	return m
}

// run calls f and returns the commands that scripts ran on key meanwhile.
// An ECHO before and one after f mark where f's commands begin and end in
// the feed.
func (m *scriptMonitor) run(t *testing.T, key string, f func()) []luaCommand {
	t.Helper()
	m.skipTo(t, m.mark(t), nil)
	f()
	var cmds []luaCommand
	m.skipTo(t, m.mark(t), func(words []string) {
		if len(words) > 1 && words[1] == key {
			cmds = append(cmds, luaCommand{name: strings.ToLower(words[0]), args: words[1:]})
		}
	})
	return cmds
}

// mark sends an ECHO of a new marker and returns the marker.
func (m *scriptMonitor) mark(t *testing.T) string {
	t.Helper()
	m.seq++
	marker := fmt.Sprintf("spillway-monitor-mark-%d", m.seq)
	if err := m.rdb.Echo(ctxT(t), marker).Err(); err != nil {
		t.Fatal(err)
	}
	return marker
}

// skipTo reads the feed up to the ECHO of marker, passing the words of each
// command a script ran to lua (when not nil).
func (m *scriptMonitor) skipTo(t *testing.T, marker string, lua func(words []string)) {
	t.Helper()
	if err := m.c.SetReadDeadline(time.Now().Add(20 * time.Second)); err != nil {
		t.Fatal(err)
	}
	for {
		line, err := m.r.ReadString('\n')
		if err != nil {
			t.Fatalf("read MONITOR: %v", err)
		}
		_, rest, ok := strings.Cut(line, "] ")
		if !ok {
			continue
		}
		words := monitorWords(rest)
		if len(words) == 2 && words[0] == "echo" && words[1] == marker {
			return
		}
		if lua != nil && strings.Contains(line, " lua] ") {
			lua(words)
		}
	}
}

// monitorWords splits the quoted words of a MONITOR line. Escapes are kept
// as they are: only the number and the plain words matter here.
func monitorWords(s string) []string {
	var words []string
	for {
		i := strings.IndexByte(s, '"')
		if i < 0 {
			return words
		}
		s = s[i+1:]
		var b strings.Builder
		for len(s) > 0 && s[0] != '"' {
			if s[0] == '\\' && len(s) > 1 {
				b.WriteByte(s[0])
				s = s[1:]
			}
			b.WriteByte(s[0])
			s = s[1:]
		}
		words = append(words, b.String())
		if len(s) > 0 {
			s = s[1:]
		}
	}
}

// fieldWork is the number of hash fields that cmds name or visit: the fields
// of HMGET, HDEL, HSET and the like, COUNT for HSCAN, and hashLen for a
// command that reads the whole hash.
func fieldWork(cmds []luaCommand, hashLen int64) int64 {
	var n int64
	for _, c := range cmds {
		switch c.name {
		case "hmget", "hdel":
			n += int64(len(c.args) - 1)
		case "hset":
			n += int64(len(c.args)-1) / 2
		case "hget", "hsetnx", "hincrby", "hexists":
			n++
		case "hscan":
			count := int64(10)
			for i := 2; i+1 < len(c.args); i++ {
				if strings.EqualFold(c.args[i], "count") {
					count, _ = strconv.ParseInt(c.args[i+1], 10, 64)
				}
			}
			n += count
		case "hkeys", "hvals", "hgetall":
			n += hashLen
		}
	}
	return n
}

// summary names cmds briefly, for failure messages: "hmget×3 hkeys×1".
func summary(cmds []luaCommand) string {
	var names []string
	counts := map[string]int{}
	for _, c := range cmds {
		if counts[c.name] == 0 {
			names = append(names, c.name)
		}
		counts[c.name]++
	}
	var b strings.Builder
	for _, name := range names {
		fmt.Fprintf(&b, " %s×%d", name, counts[name])
	}
	return strings.TrimSpace(b.String())
}

// fillSeconds writes count into each counter of suffixes for every second
// of [from, to], in batches.
func fillSeconds(t testing.TB, rdb redis.UniversalClient, key string, from, to int64, suffixes []string, count int64) {
	t.Helper()
	var args []any
	flush := func() {
		if len(args) > 0 {
			if err := rdb.HSet(ctxT(t), key, args...).Err(); err != nil {
				t.Fatal(err)
			}
			args = args[:0]
		}
	}
	for s := from; s <= to; s++ {
		for _, suffix := range suffixes {
			args = append(args, fmt.Sprintf("%d:%s", s, suffix), count)
		}
		if len(args) >= 20_000 {
			flush()
		}
	}
	flush()
}

// nextSecond waits until Redis's clock is in a second after s, and returns it.
func nextSecond(t testing.TB, rdb redis.UniversalClient, s int64) int64 {
	t.Helper()
	for {
		if now := redisNow(t, rdb).Unix(); now > s {
			return now
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// allSuffixes are lib.lua's suffixes(): every counter a second can hold.
var allSuffixes = []string{"s", "f", "t", "a1", "a2", "a3", "a4", "g", "b", "ds", "dn"}

// TestWindowReadAfterTransitionIsIncremental: after a transition the
// controller reads (from, now] at every evaluation, with the same from, until
// the window slides past it. Those reads must move cached totals forward as
// the sliding window's reads do, not sum every second since the transition at
// every read: up to an hour, 32,000 fields, tens of milliseconds of Redis.
func TestWindowReadAfterTransitionIsIncremental(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client()
	mon := startMonitor(t, srv)
	c := newClient(t, rdb)
	p := policy(10)
	p.BreakerWindow = time.Hour
	mustPublish(t, c, p)
	now := redisNow(t, rdb).Unix()
	fillSeconds(t, rdb, c.Keys().Stats, now-3650, now-1, allSuffixes, 3)
	key := c.Keys().Stats

	read := func(what string, from time.Time) {
		t.Helper()
		var (
			w   protocol.Window
			at  time.Time
			err error
		)
		cmds := mon.run(t, key, func() { w, _, at, err = c.ReadWindow(ctxT(t), time.Hour, from) })
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if n := fieldWork(cmds, 0); n > maxFieldsPerScript {
			t.Errorf("%s: the script named or visited %d fields (%s), want at most %d", what, n, summary(cmds), maxFieldsPerScript)
		}
		if want := windowFromCounters(t, rdb, c, at.Unix(), 3600, from); w != want {
			t.Errorf("%s at %v = %+v, the counters sum to %+v", what, at, w, want)
		}
	}

	// The sliding hour, read every second before the transition, then a
	// read right after it: (from, now] is a second or two.
	mustWindow(t, c, time.Hour, time.Time{})
	s := nextSecond(t, rdb, now)
	read("sliding hour", time.Time{})
	s = nextSecond(t, rdb, s)
	read("first read after a transition", time.Unix(s-1, 0))

	// A transition 3,000 s ago: the controller read the window once since
	// (the first read after a restart sums it), then reads it every second.
	from := time.Unix(s-3000, 0)
	mustWindow(t, c, time.Hour, from)
	for i := range 3 {
		s = nextSecond(t, rdb, s)
		read(fmt.Sprintf("read %d, 3,000 s after a transition", i+1), from)
	}
}

// TestReadWindowAfterTransitionFollowsTheCounters: the controller passes the
// same from at every read after a transition, while the window grows up to
// its length and then slides on. Every read must equal the sum of the
// per-second counters it covers, before, across and after that change.
func TestReadWindowAfterTransitionFollowsTheCounters(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)
		mustPublish(t, c, policy(1000))
		rng := rand.New(rand.NewPCG(5, 6))
		const length = 3 * time.Second
		reads, growing := 0, 0
		from := redisNow(t, rdb).Add(-time.Second)
		for end := time.Now().Add(6 * time.Second); time.Now().Before(end); {
			reportAtRandom(t, c, rng)
			w, _, at, err := c.ReadWindow(ctx, length, from)
			if err != nil {
				t.Fatal(err)
			}
			if want := windowFromCounters(t, rdb, c, at.Unix(), int64(length/time.Second), from); w != want {
				t.Fatalf("ReadWindow(%v, from %v) at %v = %+v, the counters sum to %+v", length, from, at, w, want)
			}
			if at.Unix()-int64(length/time.Second) < from.Unix() {
				growing++
			}
			reads++
			time.Sleep(time.Duration(rng.IntN(80)) * time.Millisecond)
		}
		if reads < 30 || growing == 0 || growing == reads {
			t.Errorf("%d reads, %d of them before the window slid past the transition; want at least 30, some of each", reads, growing)
		}
	})
}

// TestStatsFarBehindSweepIsIncremental: two hours of counters behind a
// cursor that lags two hours (the controller was down while workers kept
// reporting) must be deleted in steps, each touching a bounded number of
// fields, not by one read of the whole hash.
func TestStatsFarBehindSweepIsIncremental(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client()
	mon := startMonitor(t, srv)
	c := newClient(t, rdb)
	p := policy(1_000_000) // retention 2 min
	mustPublish(t, c, p)
	retention := int64(protocol.StatsRetention(p) / time.Second)
	key := c.Keys().Stats
	now := redisNow(t, rdb).Unix()
	fillSeconds(t, rdb, key, now-7200, now-1, allSuffixes, 1)
	if err := rdb.HSet(ctxT(t), key, "pruned", now-7300).Err(); err != nil {
		t.Fatal(err)
	}
	// Every counter of a second (allSuffixes) within the retention, a
	// margin for the seconds that pass, and the bookkeeping fields.
	perSecond := int64(len(allSuffixes))
	bound := perSecond*(retention+5) + perSecond*4 + 30
	// Read until the sweep is over and the cursor has caught up with the
	// retention.
	var target int64
	for i := 1; ; i++ {
		n, err := rdb.HLen(ctxT(t), key).Result()
		if err != nil {
			t.Fatal(err)
		}
		st, err := rdb.HMGet(ctxT(t), key, "sweep", "pruned").Result()
		if err != nil {
			t.Fatal(err)
		}
		pruned, _ := strconv.ParseInt(fmt.Sprint(st[1]), 10, 64)
		target = redisNow(t, rdb).Unix() - retention
		if n <= bound && st[0] == nil && pruned >= target-1 {
			break
		}
		if i > 2000 {
			t.Fatalf("after %d window reads the stats hash holds %d fields (want at most %d), sweep %v, pruned %v (want %d)", i, n, bound, st[0], st[1], target)
		}
		cmds := mon.run(t, key, func() { mustWindow(t, c, 30*time.Second, time.Time{}) })
		if w := fieldWork(cmds, n); w > maxFieldsPerScript {
			t.Fatalf("window read %d over %d fields named or visited %d fields (%s), want at most %d", i, n, w, summary(cmds), maxFieldsPerScript)
		}
	}
	for s := range statsSeconds(t, rdb, c) {
		if s <= target-1 {
			t.Errorf("second %d (%d s ago) survived the sweep with retention %d s", s, target+retention-s, retention)
		}
	}
}

// TestStatsBoundedWithoutController: with no controller reading the window
// and no failed job asking the budget, releases alone keep the stats hash
// bounded. Two hours of reports (one successful call a second) are written
// behind the cursor of a controller that went away two hours ago; within
// 45 s of releases (about 20 s are enough) the hash must hold only the
// retention's seconds, and no release may touch more than a bounded number
// of fields.
func TestStatsBoundedWithoutController(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client()
	mon := startMonitor(t, srv)
	c := newClient(t, rdb)
	p := policy(1_000_000) // retention 2 min
	mustPublish(t, c, p)
	retention := int64(protocol.StatsRetention(p) / time.Second)
	key := c.Keys().Stats
	mustWindow(t, c, p.BreakerWindow, time.Time{}) // the controller's last read
	now := redisNow(t, rdb).Unix()
	fillSeconds(t, rdb, key, now-7200, now-1, []string{"s", "a1"}, 1)
	if err := rdb.HSet(ctxT(t), key, "pruned", now-7300).Err(); err != nil {
		t.Fatal(err)
	}
	bound := 9*(retention+5) + 9*4 + 30
	var n int64
	for end := time.Now().Add(45 * time.Second); time.Now().Before(end); {
		var err error
		if n, err = rdb.HLen(ctxT(t), key).Result(); err != nil {
			t.Fatal(err)
		}
		if n <= bound {
			break
		}
		for _, o := range []protocol.Outcome{protocol.Success, protocol.Failure, protocol.Timeout} {
			cmds := mon.run(t, key, func() {
				if _, err := c.Release(ctxT(t), "", 0, o, 1); err != nil {
					t.Fatal(err)
				}
			})
			if w := fieldWork(cmds, n); w > maxFieldsPerScript {
				t.Fatalf("a release over %d fields named or visited %d fields (%s), want at most %d", n, w, summary(cmds), maxFieldsPerScript)
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	if n > bound {
		t.Fatalf("after 45 s of releases with no controller, the stats hash holds %d fields, want at most %d", n, bound)
	}
	if ttl, err := rdb.TTL(ctxT(t), key).Result(); err != nil || ttl <= 0 {
		t.Errorf("stats TTL = %v (%v), want an expiry", ttl, err)
	}
}

// rollUp writes what keep_stats (release, budget) would have written had
// the counters of [from, seen + 60) been reported live: 'rolled_from' = from,
// 'seen' = seen, the minute of the last report, and the totals
// '<minute>:m<suffix>' of each minute before it.
func rollUp(t testing.TB, rdb redis.UniversalClient, key string, from, seen int64) {
	t.Helper()
	fields, err := rdb.HGetAll(ctxT(t), key).Result()
	if err != nil {
		t.Fatal(err)
	}
	totals := map[string]int64{}
	for k, v := range fields {
		sec, suffix, ok := strings.Cut(k, ":")
		s, err := strconv.ParseInt(sec, 10, 64)
		if !ok || err != nil || strings.HasPrefix(suffix, "m") || s < from || s >= seen {
			continue
		}
		n, _ := strconv.ParseInt(v, 10, 64)
		totals[fmt.Sprintf("%d:m%s", s-s%60, suffix)] += n
	}
	args := []any{"rolled_from", from, "seen", seen}
	for k, n := range totals {
		args = append(args, k, n)
	}
	if err := rdb.HSet(ctxT(t), key, args...).Err(); err != nil {
		t.Fatal(err)
	}
}

// TestColdHourReadIsBounded: the first read of a 1 h window (the controller
// started, or read nothing for 50 s) and the first budget decision over a
// 1 h budget window (or one after 50 s without any) find no cached totals
// to move forward. Summing an hour second by second names 32,400 fields
// (window) or 14,400 (budget): tens of milliseconds of Redis. With the
// minute totals that reports keep, the sum must stay bounded, and exact:
// for a dependency reported on until now, and for one whose reports stopped
// five minutes ago (the minutes since have no counters, nor totals).
func TestColdHourReadIsBounded(t *testing.T) {
	t.Parallel()
	for _, quiet := range []int64{0, 5} {
		t.Run(fmt.Sprintf("quiet for %d minutes", quiet), func(t *testing.T) {
			t.Parallel()
			srv := redistest.Start(t)
			rdb := srv.Client()
			mon := startMonitor(t, srv)
			c := newClient(t, rdb)
			p := policy(1_000_000)
			p.BreakerWindow, p.Budget.Window = time.Hour, time.Hour
			mustPublish(t, c, p)
			key := c.Keys().Stats
			now := redisNow(t, rdb).Unix()
			minute := now - now%60
			// An hour and a bit of reports: counters in every second up to
			// quiet minutes ago, the totals of every minute but the last.
			last := minute - 60*quiet
			if quiet == 0 {
				fillSeconds(t, rdb, key, now-3700, now-1, allSuffixes, 2)
			} else {
				last -= 60
				fillSeconds(t, rdb, key, now-3700, last+59, allSuffixes, 2)
			}
			rollUp(t, rdb, key, minute-3720, last)
			for i := range 3 {
				coldReads(t, mon, rdb, c, i+1)
				time.Sleep(300 * time.Millisecond)
			}
		})
	}
}

// coldReads reads the 1 h window and asks the 1 h budget with no cached
// totals, and checks the work and the answers.
func coldReads(t *testing.T, mon *scriptMonitor, rdb redis.UniversalClient, c *protocol.Client, i int) {
	t.Helper()
	key := c.Keys().Stats
	var (
		w   protocol.Window
		at  time.Time
		err error
	)
	if err := rdb.HDel(ctxT(t), key, "window_upto", "budget_upto").Err(); err != nil {
		t.Fatal(err)
	}
	cmds := mon.run(t, key, func() { w, _, at, err = c.ReadWindow(ctxT(t), time.Hour, time.Time{}) })
	if err != nil {
		t.Fatal(err)
	}
	if n := fieldWork(cmds, 0); n > maxColdHourWindowFields {
		t.Errorf("cold read %d of a 1 h window named or visited %d fields (%s), want at most %d", i, n, summary(cmds), maxColdHourWindowFields)
	}
	if want := windowFromCounters(t, rdb, c, at.Unix(), 3600, time.Time{}); w != want {
		t.Errorf("cold read %d at %v = %+v, the counters sum to %+v", i, at, w, want)
	}
	var d protocol.BudgetDecision
	before := redisNow(t, rdb)
	cmds = mon.run(t, key, func() { d, err = c.RetryBudget(ctxT(t)) })
	if err != nil {
		t.Fatal(err)
	}
	if n := fieldWork(cmds, 0); n > maxFieldsPerScript {
		t.Errorf("cold budget decision %d over 1 h named or visited %d fields (%s), want at most %d", i, n, summary(cmds), maxFieldsPerScript)
	}
	if after := redisNow(t, rdb); after.Unix() == before.Unix() {
		grant := int64(0)
		if d.Allowed {
			grant = 1
		}
		if want := windowFromCounters(t, rdb, c, before.Unix(), 3600, time.Time{}); d.Calls != want.Calls || d.Granted+grant != want.RetriesGranted {
			t.Errorf("cold budget decision %d counted %d calls and %d granted; the counters hold %d and %d, this decision included (%d)",
				i, d.Calls, d.Granted, want.Calls, want.RetriesGranted, grant)
		}
	}
}

// TestMinuteTotals: the first report in a minute writes the totals of the
// minute of the previous report ('seen'), which equal the sums of its
// seconds, and moves 'seen'; the first report of all starts 'rolled_from'.
func TestMinuteTotals(t *testing.T) {
	t.Parallel()
	forEachTopology(t, func(t *testing.T, rdb redis.UniversalClient) {
		c := newClient(t, rdb)
		ctx := ctxT(t)
		mustPublish(t, c, policy(1000))
		key := c.Keys().Stats
		if _, err := c.Release(ctx, "", 0, protocol.Failure, 2); err != nil {
			t.Fatal(err)
		}
		now := redisNow(t, rdb).Unix()
		minute := now - now%60
		got, err := rdb.HMGet(ctx, key, "seen", "rolled_from").Result()
		if err != nil {
			t.Fatal(err)
		}
		if s, _ := got[0].(string); s != strconv.FormatInt(minute, 10) && s != strconv.FormatInt(minute-60, 10) {
			t.Fatalf("after the first report seen = %v, want the minute %d", got[0], minute)
		}
		if got[0] != got[1] {
			t.Errorf("after the first report rolled_from = %v, want seen (%v)", got[1], got[0])
		}

		// Reports in a minute of ten minutes ago, the last one then.
		past := minute - 600
		rng := rand.New(rand.NewPCG(7, 8))
		counts := map[int64]map[string]int64{}
		want := map[string]int64{}
		for s := past; s < past+60; s += 1 + int64(rng.IntN(5)) {
			counts[s-now] = map[string]int64{}
			for _, suffix := range allSuffixes {
				n := int64(rng.IntN(4))
				counts[s-now][suffix] = n
				want[suffix] += n
			}
		}
		hsetSeconds(t, rdb, c, now, counts)
		if err := rdb.HSet(ctx, key, "seen", past, "rolled_from", past-600).Err(); err != nil {
			t.Fatal(err)
		}
		// The first success of its second (the first report was a failure).
		if _, err := c.Release(ctx, "", 0, protocol.Success, 1); err != nil {
			t.Fatal(err)
		}
		now = redisNow(t, rdb).Unix()
		for _, suffix := range allSuffixes {
			n, err := rdb.HGet(ctx, key, fmt.Sprintf("%d:m%s", past, suffix)).Int64()
			if err == redis.Nil {
				n, err = 0, nil
			}
			if err != nil || n != want[suffix] {
				t.Errorf("total of %q over the minute %d = %d (%v), its seconds sum to %d", suffix, past, n, err, want[suffix])
			}
		}
		if s, err := rdb.HGet(ctx, key, "seen").Int64(); err != nil || s != now-now%60 {
			t.Errorf("seen = %d (%v), want this minute %d", s, err, now-now%60)
		}
		// The 1 h window reads the totals of that minute and skips the nine
		// minutes after it, which have no reports.
		w, _, at, err := c.ReadWindow(ctx, time.Hour, time.Time{})
		if err != nil {
			t.Fatal(err)
		}
		if want := windowFromCounters(t, rdb, c, at.Unix(), 3600, time.Time{}); w != want {
			t.Errorf("1 h window at %v = %+v, the counters sum to %+v", at, w, want)
		}

		// After a clock step back (seen is a later minute) no minute is
		// claimed: both fields restart at this minute.
		if err := rdb.HSet(ctx, key, "seen", now-now%60+600).Err(); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Release(ctx, "", 0, protocol.Timeout, 1); err != nil { // the first timeout of its second
			t.Fatal(err)
		}
		got, err = rdb.HMGet(ctx, key, "seen", "rolled_from").Result()
		if err != nil {
			t.Fatal(err)
		}
		if m := redisNow(t, rdb).Unix(); got[0] != got[1] || (got[0] != strconv.FormatInt(m-m%60, 10) && got[0] != strconv.FormatInt(m-m%60-60, 10)) {
			t.Errorf("after a clock step back seen = %v and rolled_from = %v, want both this minute (%d)", got[0], got[1], m-m%60)
		}
	})
}

// TestColdHourReadOfAYoungHash: a dependency whose stats hash is minutes old
// (a new policy, or the first hour after an upgrade to new keys) has no
// counters before the hash was made, whichever script made it. A cold read
// of a 1 h window must not name the seconds of the hour before.
func TestColdHourReadOfAYoungHash(t *testing.T) {
	t.Parallel()
	for _, first := range []string{"release", "window", "budget"} {
		t.Run("made by "+first, func(t *testing.T) {
			t.Parallel()
			srv := redistest.Start(t)
			rdb := srv.Client()
			mon := startMonitor(t, srv)
			c := newClient(t, rdb)
			ctx := ctxT(t)
			p := policy(1_000_000)
			p.BreakerWindow, p.Budget.Window = time.Hour, time.Hour
			mustPublish(t, c, p)
			switch first {
			case "release":
				if _, err := c.Release(ctx, "", 0, protocol.Success, 1); err != nil {
					t.Fatal(err)
				}
			case "window":
				mustWindow(t, c, time.Hour, time.Time{})
			case "budget":
				if _, err := c.RetryBudget(ctx); err != nil {
					t.Fatal(err)
				}
			}
			rng := rand.New(rand.NewPCG(9, 10))
			for range 20 {
				reportAtRandom(t, c, rng)
			}
			for i := range 2 {
				coldReads(t, mon, rdb, c, i+1)
			}
		})
	}
}
