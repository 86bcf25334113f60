package protocol

import (
	"cmp"
	"slices"
)

// PerCallContender is the contender name of live anonymous per-call demand
// in a fair split: per-call workers without a caller id refused for want of
// a slot count together as one contender that wants the whole limit.
const PerCallContender = "percall"

// PerCallerContender is the contender name of the per-call caller id
// (AcquireArgs.CallerID) in a fair split: each caller refused for want of a
// slot within the last second is a contender of its own that wants the
// whole limit, so that k per-call processes count as k.
func PerCallerContender(id string) string { return PerCallContender + ":" + id }

// FairShares is the fair-share rule pool.lua applies (docs/protocol.md §4
// pool): the max-min fair split of limit over the contenders' wants (each
// above 0). Wants at or below the water level are met in full; the others
// get the level, floor(what is left / how many), and the remainder goes one
// slot each to the first of them by name, so that the shares add up to the
// limit whenever the wants do. Every contender gets at least
// min(want, floor(limit / contenders)). Live per-call demand enters as
// contenders that each want limit: PerCallerContender(id) for each caller id
// refused within the last second, and PerCallContender for the anonymous
// ones together. The script and this function must agree
// (TestPoolSharesMatchFairShares).
func FairShares(limit int64, wants map[string]int64) map[string]int64 {
	type contender struct {
		name string
		want int64
	}
	cs := make([]contender, 0, len(wants))
	for name, w := range wants {
		if w > 0 {
			cs = append(cs, contender{name, w})
		}
	}
	slices.SortFunc(cs, func(a, b contender) int {
		return cmp.Or(cmp.Compare(a.want, b.want), cmp.Compare(a.name, b.name))
	})
	shares := make(map[string]int64, len(cs))
	left, i := limit, 0
	for ; i < len(cs) && cs[i].want <= left/int64(len(cs)-i); i++ {
		shares[cs[i].name] = cs[i].want
		left -= cs[i].want
	}
	rest := cs[i:]
	if len(rest) == 0 {
		return shares
	}
	level := left / int64(len(rest))
	rem := left - level*int64(len(rest))
	slices.SortFunc(rest, func(a, b contender) int { return cmp.Compare(a.name, b.name) })
	for j, c := range rest {
		shares[c.name] = level
		if int64(j) < rem {
			shares[c.name]++
		}
	}
	return shares
}
