-- pool: refresh a process's local pool of fleet slots in one round trip:
-- renew the slots it still holds, take back the ones it returns, count its
-- aggregated outcome report, and grant new slots and rate tokens up to what
-- is free and fair.
-- KEYS[1] state  KEYS[2] leases  KEYS[3] gcra  KEYS[4] stats  KEYS[5] pools
-- KEYS[6] wants  KEYS[7] callers  KEYS[8] calls
-- ARGV[1] pool id  ARGV[2] request id  ARGV[3] deadline ms (Redis time, 0
-- for none)  ARGV[4] lease ttl ms  ARGV[5] want (slots the process could use
-- now: in flight + waiting)  ARGV[6] rate tokens wanted  ARGV[7] token lead
-- µs (the least time a granted token stays usable after the script ran)
-- ARGV[8] h, the number of held members  ARGV[9] r, the number of returned
-- members  ARGV[10..18] the report since the last one: s f t a1 a2 a3 a4 ds
-- dn  ARGV[19..18+h] held members  ARGV[19+h..18+h+r] returned members.
-- Returns {0, epoch, state, limit, open_until_ms, now_ms, stale 0|1, share,
-- excess, {granted members}, {lost members}, tokens, first token due µs,
-- token interval µs, token spread µs}, {5} no policy, {6, state version,
-- manager version} (lib.lua version_refusal), {7, now ms} late: the request
-- ran after its deadline and wrote nothing but the returned members, which
-- every answer takes back.
-- While the dependency learns (lib.lua learning), held members that Redis
-- lost are put back and kept, and nothing is granted; with no state stored
-- they are put back before {5}.
-- Idempotent per request id: a resend of the pool's last request answers the
-- first run's reply and writes nothing, whatever the state is now: checked
-- before the policy and its version, so that a resend after the policy was
-- deleted or another version published is not answered {5} or {6}, which
-- would have the pool send again a report that Redis already counted.

-- Records the pool's want and held slots with the time, in the wants hash:
-- '<want> <held> <now ms>'.
local function pool_want(wants, id, want, held, now_ms)
  redis.call('HSET', wants, id, int(want) .. ' ' .. int(held) .. ' ' .. int(now_ms))
  redis.call('PEXPIRE', wants, 3600000)
end

-- Whether string a sorts before b byte by byte. Lua's own '<' on strings
-- follows the server's locale (Redis sets LC_COLLATE from its environment),
-- which may ignore '-' or fold case: every pool must see one order, the one
-- Go's FairShares uses.
local function before(a, b)
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end

-- The max-min fair split of limit over the live contenders: the entries of
-- the wants hash written in the last second with a want above 0 (the
-- calling pool's own with its current want and waiting), and live per-call
-- demand as contenders that each want the whole limit: every member of the
-- callers set scored in the last second (a per-call caller that acquire
-- refused for want of a slot, named 'percall:<caller id>'), and the
-- anonymous callers together (the field 'percall', written by a refused
-- acquire within the last second) as one. Wants at or below
-- the water level are met in full; the others get the level, floor(what is
-- left / how many), and the remainder goes one slot each to the first of
-- them by id (byte order), so the shares add up to the limit exactly
-- (protocol.FairShares in Go). Returns the split
-- as {level, remainder, edge (the id of the last contender given one slot
-- more), waiting contenders (want above held; per-call demand always
-- waits), per-call contenders}. Deletes up to 8 entries silent for 10
-- minutes, with their pools records.
local function pool_split(wants, callers, pools, id, want, waiting, limit, now_ms)
  local all = redis.call('HGETALL', wants)
  local cont, nwait, percall, dead = {}, 0, 0, 0
  if want > 0 then cont[1] = {id, want} end
  if waiting then nwait = 1 end
  for _, c in ipairs(redis.call('ZRANGEBYSCORE', callers, int(now_ms - 1000), '+inf')) do
    cont[#cont + 1] = {'percall:' .. c, limit}
    nwait, percall = nwait + 1, percall + 1
  end
  for i = 1, #all, 2 do
    local f, v = all[i], all[i + 1]
    if f == 'percall' then
      if now_ms - (tonumber(v) or 0) <= 1000 then
        cont[#cont + 1] = {f, limit}
        nwait, percall = nwait + 1, percall + 1
      end
    elseif f ~= id and f ~= 'split' then
      local w, h, at = string.match(v, '^(%d+) (%d+) (%d+)$')
      w, h, at = tonumber(w), tonumber(h), tonumber(at)
      if at and now_ms - at <= 1000 then
        if w > 0 then
          cont[#cont + 1] = {f, w}
          if w > h then nwait = nwait + 1 end
        end
      elseif (not at or now_ms - at > 600000) and dead < 8 then
        dead = dead + 1
        redis.call('HDEL', wants, f)
        redis.call('HDEL', pools, f .. ':req', f .. ':reply', f .. ':next')
      end
    end
  end
  table.sort(cont, function(a, b)
    if a[2] ~= b[2] then return a[2] < b[2] end
    return before(a[1], b[1])
  end)
  local left, n, i = limit, #cont, 1
  while i <= #cont and cont[i][2] <= math.floor(left / n) do
    left, n, i = left - cont[i][2], n - 1, i + 1
  end
  local level, rem, edge = limit, 0, ''
  if n > 0 then
    level = math.floor(left / n)
    rem = left - level * n
    if rem > 0 then
      local ids = {}
      for j = i, #cont do ids[#ids + 1] = cont[j][1] end
      table.sort(ids, before)
      edge = ids[rem]
    end
  end
  return {level, rem, edge, nwait, percall}
end

-- A pool's share in a split: its want when at or below the level, else the
-- level, plus one when its id is at or before the edge.
local function pool_share(split, id, want)
  if want <= split[1] then return want end
  if split[2] > 0 and not before(split[3], id) then return split[1] + 1 end
  return split[1]
end

-- The split is cached in the wants hash (field 'split': '[d]<at ms> <limit>
-- <level> <remainder> <waiting> <per-call contenders> <edge>') so that a
-- refresh costs one HMGET and one ZCOUNT, not a pass over every process's
-- entry. The cache serves for 250 ms at most, and never for another limit.
-- Within that it no longer describes the contenders when the number of live
-- per-call contenders changed, when the calling pool's own entry is not the
-- one it was computed with in what matters (live, wanting, waiting, at or
-- below the level), or when another pool started or stopped waiting, which
-- marks it dirty (the leading 'd'); it is then computed again, but not more
-- often than every split_every_ms. A computation reads every process's
-- entry (about 5 µs of Redis CPU each), and pools whose demand hovers at
-- the level flip on every refresh: without the floor every refresh of every
-- pool would pay for it, 25 × N computations a second of N × 5 µs. Shares
-- then lag the contenders by at most split_every_ms (a pool that starts
-- waiting is seen by the holders within it and their next refresh), and a
-- want that moves within the same side of the level moves the others'
-- shares a little for at most 250 ms; grants never exceed the free slots
-- whatever the share says.
local split_every_ms = 50

-- The cached split (nil when absent, older than 250 ms or for another
-- limit), with its age in ms and whether it is dirty.
local function split_cached(cached, limit, now_ms)
  if not cached then return nil end
  local dirty = string.sub(cached, 1, 1) == 'd'
  if dirty then cached = string.sub(cached, 2) end
  local at, lim, level, rem, nwait, pc, edge = string.match(cached,
    '^(%d+) (%d+) (%d+) (%d+) (%d+) (%d+) ?(.*)$')
  if not at or now_ms - tonumber(at) > 250 or tonumber(lim) ~= limit then
    return nil
  end
  return {tonumber(level), tonumber(rem), edge, tonumber(nwait), tonumber(pc)}, now_ms - tonumber(at), dirty
end

-- Grants up to n new members '<pool id>:<k>', k counting up from the pool's
-- 'next', added with ZADD NX at expiry. A member that is already there (an
-- expired member of an earlier pool of the same id, whose record was
-- deleted) is skipped: it is not live and must not be revived. empty: no
-- live lease was held, so the set may be new and gets the encoding member
-- (acquire.lua).
local function pool_grant(leases, pools, id, next_k, n, expiry, empty)
  local k = tonumber(next_k) or 1
  local pairs_, members = {}, {}
  if empty then
    redis.call('ZADD', leases, 'NX', '-inf',
      'encoding: this member is longer than 64 bytes so that Redis keeps a skiplist')
  end
  local e = int(expiry)
  for j = 1, n do
    members[j] = id .. ':' .. int(k + j - 1)
    pairs_[#pairs_ + 1] = e
    pairs_[#pairs_ + 1] = members[j]
  end
  k = k + n
  local added = redis.call('ZADD', leases, 'NX', unpack(pairs_))
  local granted = members
  if added < n then
    -- Rare: some were there. Ours carry this call's expiry; an old one's
    -- score is long past.
    granted = {}
    local scores = redis.call('ZMSCORE', leases, unpack(members))
    for j = 1, n do
      if tonumber(scores[j]) == expiry then granted[#granted + 1] = members[j] end
    end
  end
  redis.call('HSET', pools, id .. ':next', int(k))
  return granted
end

-- Leases up to wanted rate tokens from the GCRA (rate_interval_us interval,
-- rate_burst burst), as wanted per-call acquisitions would, all at now: the
-- tokens take the emission times due_j = first + j × interval (j = 0 … k-1)
-- from first = max(tat, now + lead), k the most per-call GCRA would admit
-- (due_j − (burst − 1) × interval <= now), and the stored TAT moves to
-- first + k × interval. Token j may start a call at any time in
-- [due_j − spread, due_j], spread = (burst − 1) × interval: every start,
-- per-call or pooled, then lies within spread before its own emission time,
-- which bounds the starts of any window of length w by w / interval + burst,
-- the per-call bound. With spread <= lead (burst 1: rates below 20/s) a
-- token would be dead on arrival: none is granted and those calls go
-- per-call. Returns k, first, interval, spread (µs).
local function pool_tokens(gcra, interval_s, burst_s, wanted_s, lead_s, now)
  local interval = math.floor(tonumber(interval_s) or 0)
  local wanted = math.floor(tonumber(wanted_s) or 0)
  if interval <= 0 then return 0, 0, 0, 0 end
  local spread = (math.max(1, math.floor(tonumber(burst_s) or 1)) - 1) * interval
  local lead = math.max(0, math.floor(tonumber(lead_s) or 0))
  if wanted <= 0 or spread <= lead then return 0, 0, interval, spread end
  local tat = tonumber(redis.call('GET', gcra)) or now
  local first = math.max(tat, now + lead)
  local k = math.min(wanted, math.floor((now + spread - first) / interval) + 1)
  if k <= 0 then return 0, 0, interval, spread end
  local next_tat = first + k * interval
  redis.call('SET', gcra, int(next_tat), 'PX', int(math.ceil((next_tat - now) / 1000) + 1000))
  return k, first, interval, spread
end

local now = now_us()
local now_ms = math.floor(now / 1000)
local id = ARGV[1]

local function read_state()
  return redis.call('HMGET', KEYS[1], 'version', 'state', 'limit', 'epoch',
    'rate_interval_us', 'rate_burst', 'open_until_ms', 'updated_at_ms',
    'stale_after_ms', 'replid', 'learn_until_ms', 'replid_at_ms')
end
-- A resend (the reply of the first run was lost and the client library, or
-- the pool, sent the same request again) answers as the first run did: its
-- members were granted once, its report counted once.
local rec = redis.call('HMGET', KEYS[5], id .. ':req', id .. ':reply', id .. ':next')
if rec[1] == ARGV[2] and rec[2] then return cmsgpack.unpack(rec[2]) end

local ttl = tonumber(ARGV[4])
local nheld = math.floor(tonumber(ARGV[8]))
local own = id .. ':'
local function mine(m) return string.sub(m, 1, #own) == own end
local function held_members()
  local members = {}
  for i = 19, 18 + nheld do
    if mine(ARGV[i]) then members[#members + 1] = ARGV[i] end
  end
  return members
end

-- Returned members are written expired, not removed: acquire counts only
-- members scored after now, and a member that is there cannot be added
-- again (pool grants with ZADD NX), so nothing late revives it. Sweeps
-- remove them. They are taken back whatever the answer: a pool refused for
-- no policy or another version ({5}, {6}), or late ({7}), gives back its
-- idle slots too, or they would hold part of the limit for a ttl from the
-- workers that are served. Taking a member back twice changes nothing.
local nret = math.floor(tonumber(ARGV[9]))
if nret > 0 then
  local back = {}
  for i = 19 + nheld, 18 + nheld + nret do
    if mine(ARGV[i]) then
      back[#back + 1] = '0'
      back[#back + 1] = ARGV[i]
    end
  end
  if #back > 0 then redis.call('ZADD', KEYS[2], 'XX', unpack(back)) end
end

local st = read_state()
if not st[1] then
  -- Redis lost its data, or the policy was never published: nobody admits
  -- without a state, and the pool's calls that still run keep their slots.
  relearn(KEYS[2], held_members(), now_ms + ttl)
  return {5}
end
local refused = version_refusal(KEYS[1], st[1], 6)
if refused then return refused end
local learn = learning(KEYS[1], st[10], st[11], st[12], now_ms)

-- A request that waited (behind a slow script, in the socket of a paused
-- server) after its caller gave up on it must take nothing: its members
-- would hold slots that no call uses for a ttl. It counts no report either;
-- the pool sends that again. Checked after the resend, which is answered
-- as its first run was, late or not.
local deadline = tonumber(ARGV[3]) or 0
if deadline > 0 and now_ms > deadline then return {7, now_ms} end

local want = math.max(0, math.floor(tonumber(ARGV[5]) or 0))


-- Held members that are still live are kept; the others are lost (expired:
-- the fleet stopped counting them) and reported so. A kept member is
-- renewed (expiry = now + ttl) only once less than half its ttl is left:
-- a pool refreshes many times a ttl, and moving a member in the sorted set
-- is most of a refresh's cost. A dead process's slots still expire within
-- the ttl. While the dependency learns, its members that Redis lost are put
-- back first.
local kept, lost = 0, {}
if nheld > 0 then
  if learn > 0 then relearn(KEYS[2], held_members(), now_ms + ttl) end
  local members = {}
  for i = 19, 18 + nheld do members[#members + 1] = ARGV[i] end
  local scores = redis.call('ZMSCORE', KEYS[2], unpack(members))
  local renew = {}
  local expiry = int(now_ms + ttl)
  local due = now_ms + ttl / 2
  for i, m in ipairs(members) do
    local s = tonumber(scores[i])
    if mine(m) and s and s > now_ms then
      if s <= due then
        renew[#renew + 1] = expiry
        renew[#renew + 1] = m
      end
      kept = kept + 1
    else
      lost[#lost + 1] = m
    end
  end
  if #renew > 0 then redis.call('ZADD', KEYS[2], 'XX', unpack(renew)) end
end

-- The outcome report: the same counters release writes, added to the
-- current second's, so the window reads what per-call releases would have
-- written (lib.lua keep_stats on a counter's first count in the second).
local names = suffixes()
local report = {ARGV[10], ARGV[11], ARGV[12], ARGV[13], ARGV[14], ARGV[15], ARGV[16], nil, nil, ARGV[17], ARGV[18]}
local sec = math.floor(now / 1000000)
local p = int(sec) .. ':'
local fresh = false
for i = 1, #names do
  local v = math.floor(tonumber(report[i]) or 0)
  if v > 0 then
    local got = redis.call('HINCRBY', KEYS[4], p .. names[i], v)
    if i <= 3 and got == v then fresh = true end
  end
end
if fresh then keep_stats(KEYS[4], sec) end
if KEYS[8] then
  count_version(KEYS[8], sec, math.floor((tonumber(ARGV[10]) or 0) + (tonumber(ARGV[11]) or 0) + (tonumber(ARGV[12]) or 0)))
end

-- The in-path trip (lib.lua trip), once the report is counted, when it holds
-- failures or timeouts, as release checks after each one: the aggregated
-- report is one decision over the window with all of it counted. A trip
-- writes Open, and this refresh then answers it: no slots, drop them all.
local failed = (tonumber(ARGV[11]) or 0) + (tonumber(ARGV[12]) or 0) > 0
local tripped = false
if failed then tripped = trip(KEYS[1], KEYS[4], sec, now_ms) end
if tripped then st = read_state() end

local state = st[2]
local limit = math.floor(tonumber(st[3]) or 0)
local stale = dead_man(state, st[8], st[9], now_ms)

local share, excess, granted = 0, 0, {}
local tokens, first, interval, spread = 0, 0, 0, 0
if state == 'Closed' or state == 'Ramping' then
  local live = redis.call('ZCOUNT', KEYS[2], '(' .. int(now_ms), '+inf')
  local free = limit - live
  -- The pool's entry as the split last saw it, and the split.
  local w = redis.call('HMGET', KEYS[6], 'split', id, 'percall')
  local ow, oh, oat = string.match(w[2] or '', '^(%d+) (%d+) (%d+)$')
  ow, oh = tonumber(ow) or 0, tonumber(oh) or 0
  local old_live = oat and now_ms - tonumber(oat) <= 1000
  -- Live per-call contenders: the callers scored in the last second, and
  -- the anonymous ones as one.
  local percall = redis.call('ZCOUNT', KEYS[7], int(now_ms - 1000), '+inf')
  if now_ms - (tonumber(w[3]) or 0) <= 1000 then percall = percall + 1 end
  local cached = w[1]
  local split, age, dirty = split_cached(cached, limit, now_ms)
  -- The split counted this pool as waiting as its entry said (a pool whose
  -- waiting flipped since marked the split dirty, below).
  local was_waiting = old_live and ow > oh
  if split and age >= split_every_ms and (dirty or split[5] ~= percall or
      not (old_live and (ow > 0) == (want > 0) and (ow <= split[1]) == (want <= split[1]))) then
    split = nil
  end
  if not split then
    if not old_live then was_waiting = want > kept end
    split = pool_split(KEYS[6], KEYS[7], KEYS[5], id, want, was_waiting, limit, now_ms)
    cached = int(now_ms) .. ' ' .. int(limit) .. ' ' .. int(split[1]) .. ' ' ..
      int(split[2]) .. ' ' .. int(split[4]) .. ' ' .. int(split[5]) .. ' ' .. split[3]
    redis.call('HSET', KEYS[6], 'split', cached)
  end
  share = pool_share(split, id, want)
  -- Another contender waits: the waiting ones less this pool, as the split
  -- counted it.
  local waits = split[4] - (was_waiting and 1 or 0) > 0
  -- With another contender waiting the pool holds at most its share and
  -- gives back the idle slots above it; alone, it may take every free slot
  -- it can use, and gives back only what a lowered limit took away.
  local target = want
  if waits then
    target = math.min(want, share)
    excess = math.max(0, kept - share)
  else
    excess = math.min(kept, math.max(0, -free))
  end
  local n = math.min(target - kept, free)
  if learn > 0 then n = 0 end
  if n > 0 then
    granted = pool_grant(KEYS[2], KEYS[5], id, rec[3], n, now_ms + ttl, live == 0)
  end
  local held = kept + #granted
  pool_want(KEYS[6], id, want, held, now_ms)
  -- When this pool started or stopped waiting, the others must see it once
  -- the split may be computed again: the split counted it as before.
  if (want > held) ~= was_waiting and string.sub(cached, 1, 1) ~= 'd' then
    redis.call('HSET', KEYS[6], 'split', 'd' .. cached)
  end
  tokens, first, interval, spread = pool_tokens(KEYS[3], st[5], st[6], ARGV[6], ARGV[7], now)
else
  -- Open, HalfOpen and the dead-man rule's Stale grant no pool slots: the
  -- probes stay per-call. The pool drops every slot it can.
  excess = kept
  pool_want(KEYS[6], id, 0, kept, now_ms)
end

local reply = {0, tonumber(st[4]), state, limit, tonumber(st[7]) or 0, now_ms,
  stale and 1 or 0, share, excess, granted, lost, tokens, first, interval, spread}
redis.call('HSET', KEYS[5], id .. ':req', ARGV[2], id .. ':reply', cmsgpack.pack(reply))
redis.call('PEXPIRE', KEYS[5], 3600000)
return reply
