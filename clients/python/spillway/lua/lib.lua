-- Shared by every Spillway script (protocol v6). Redis runs Lua 5.1, whose
-- numbers are doubles: integers are exact below 2^53, and tostring() keeps only
-- 14 significant digits, so every number written back to Redis goes through
-- int(), never through implicit conversion. Top-level code here only defines
-- functions: it runs on every call, so it must cost nothing.

local function int(n)
  return string.format('%d', n)
end

-- Version skew (docs/protocol.md §10). These scripts are protocol version 6.
-- The state hash's 'version' is the state version: a manager at version N
-- writes N - 1, so that its workers at N - 1 and N both act on it, and
-- workers at N act on what the managers next to them write: N - 2 (a manager
-- one version older), N - 1 and N (one version newer). A manager at 5 writes
-- 4 and one at 6 writes 5, so these scripts act on state versions 4, 5 and
-- 6 (what a manager at 7 will write), and refuse any other with {6, state
-- version, manager version} (refusal code 6; budget answers -6): the worker
-- then names both versions to its operator. 'manager_version' is the
-- version of the manager that last published; it counts only while
-- 'manager_seq' equals 'seq' (a manager at 4, which does not write it, has
-- published since: -1, unknown).
local function version_refusal(state_key, v, code)
  if v == '4' or v == '5' or v == '6' then return nil end
  local m = redis.call('HMGET', state_key, 'manager_version', 'manager_seq', 'seq')
  local manager = -1
  if m[1] and m[2] == m[3] then manager = tonumber(m[1]) or -1 end
  return {code, tonumber(v) or -1, manager}
end

-- Counts n calls (successes, failures and timeouts) made by workers of this
-- protocol version, per 10 s bucket, in the calls hash: field
-- '<bucket's first second>:6'. The manager compares them with the stats of
-- the same seconds to tell how much of the traffic older workers, which do
-- not count themselves, still make (versions.lua). The first count in a
-- bucket deletes this version's buckets 120 to 300 s old and keeps the key
-- for 120 s: every bucket is gone within 300 s, and the hash holds at most
-- 30 buckets a version.
local function count_version(calls, now_s, n)
  if n <= 0 then return end
  local b = now_s - now_s % 10
  if redis.call('HINCRBY', calls, int(b) .. ':6', n) == n then
    local old = {}
    for x = b - 300, b - 120, 10 do old[#old + 1] = int(x) .. ':6' end
    redis.call('HDEL', calls, unpack(old))
    redis.call('PEXPIRE', calls, 120000)
  end
end

-- The pub/sub channel that announces a dependency's changes: its state key
-- with the trailing 'state' replaced by 'changes' (Keys.Changes in Go).
local function changes_channel(state_key)
  return string.sub(state_key, 1, -6) .. 'changes'
end

-- Announces a change of the published state on the dependency's changes
-- channel: '<epoch> <state> <limit>'. Processes that batch slots shrink or
-- drop their pools on it without waiting for their next refresh.
local function announce_change(state_key, epoch, state, limit)
  redis.call('PUBLISH', changes_channel(state_key), epoch .. ' ' .. state .. ' ' .. limit)
end

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- Learning (docs/protocol.md §4 "Learning"). Redis can lose leases while
-- their calls still run: restarted without its data, or failed over to a
-- replica that had not received the last writes. For learn_ms after it
-- finds out, nothing new is admitted, and the holders put back the leases
-- it lost (renew, hold and pool re-add a lease that is missing while the
-- dependency learns), so that no call is admitted into a slot a running
-- call still holds. It finds out two ways:
-- - the server's replication id (INFO replication master_replid) is not
--   the one the state hash recorded in 'replid': a restart or a promotion
--   gives a server a new one, and a replica that took over received only
--   part of its master's writes. The first script on the new history sets
--   'learn_until_ms' (a state with no 'replid' yet only records it). The
--   id is read at most every replid_every_ms ('replid_at_ms' records the
--   last read, about 3 µs of Redis CPU each): a failover that loses writes
--   follows a crash that the sentinels or the cluster take a second or
--   more to agree on, so what the new master holds was recorded longer ago
--   than that, and its first admission reads the id. A recorded time ahead
--   of the server's clock reads it too;
-- - the manager publishes a state Redis no longer held over one it had
--   published before (publish.lua, 'restored').
local learn_ms = 1000
local replid_every_ms = 100

-- The ms of learning left at now_ms (0: none), after recording a new
-- replication id. replid, learn_until and replid_at are the state's fields
-- as read.
local function learning(state_key, replid, learn_until, replid_at, now_ms)
  local age = now_ms - (tonumber(replid_at) or 0)
  if not replid or age < 0 or age >= replid_every_ms then
    local id = string.match(redis.call('INFO', 'replication'), 'master_replid:(%w+)')
    if id and replid and id ~= replid then
      learn_until = now_ms + learn_ms
      redis.call('HSET', state_key, 'replid', id, 'replid_at_ms', int(now_ms), 'learn_until_ms', int(learn_until))
    elseif id then
      redis.call('HSET', state_key, 'replid', id, 'replid_at_ms', int(now_ms))
    end
  end
  local left = (tonumber(learn_until) or 0) - now_ms
  if left > 0 then return left end
  return 0
end

-- Released leases (KEYS 'released'): while the dependency learns, or with
-- no state stored, release records the leases it frees here for
-- released_keep_ms. A hold or a renewal that the holder sent before its
-- call ended can reach Redis after the release, on another connection, and
-- would put the lease back: its slot would stay taken, by nobody, until its
-- TTL passed. relearn puts back no lease recorded here.
local released_keep_ms = 10000

-- Records member as released at now_ms, and prunes the records that passed.
local function remember_released(released, member, now_ms)
  redis.call('ZREMRANGEBYSCORE', released, '-inf', int(now_ms))
  redis.call('ZADD', released, int(now_ms + released_keep_ms), member)
  redis.call('PEXPIRE', released, released_keep_ms)
end

-- Puts back the members of leases that are missing, at expiry: the leases
-- a holder still holds that Redis lost (learning, or no state at all, when
-- nobody admits). A member that is there, live or expired, is left as it
-- is, and so is one released (remember_released) when released, a key, is
-- given. Returns how many it put back.
local function relearn(leases, members, expiry, released, now_ms)
  if #members == 0 then return 0 end
  local scores = redis.call('ZMSCORE', leases, unpack(members))
  local gone = {}
  if released then gone = redis.call('ZMSCORE', released, unpack(members)) end
  local back = {}
  for i, m in ipairs(members) do
    if not scores[i] and not (gone[i] and tonumber(gone[i]) > now_ms) then
      back[#back + 1] = int(expiry)
      back[#back + 1] = m
    end
  end
  if #back == 0 then return 0 end
  redis.call('ZADD', leases, 'NX', '-inf',
    'encoding: this member is longer than 64 bytes so that Redis keeps a skiplist')
  return redis.call('ZADD', leases, 'NX', unpack(back))
end

-- The per-second counters: successes, failures, timeouts, calls by attempt
-- (1, 2, 3, 4 or more), retries granted and refused by the budget, and the
-- summed duration in microseconds (ds) of the successes whose release said
-- how long they took (dn). Calls are s + f + t.
local function suffixes()
  return {'s', 'f', 't', 'a1', 'a2', 'a3', 'a4', 'g', 'b', 'ds', 'dn'}
end

-- Sums the counters named by names over the seconds (from_s, to_s], reading
-- at most 4000 fields per HMGET: unpack() takes at most about 8000 values.
-- roll, when given, is {rolled_from, seen, the current minute, born} (see
-- keep_stats): a whole minute m of the range with rolled_from <= m < seen is
-- read from its minute totals '<m>:m<suffix>' (9 fields instead of 540), one
-- with seen < m < the current minute is skipped (no report came in it, so it
-- has no counters), and so are the seconds before rolled_from when born is
-- true (the hash had no counters then). Each second's prefix is formatted
-- once; the loops index arrays directly.
local function sum(stats, from_s, to_s, names, roll)
  local n = #names
  local totals = {}
  for i = 1, n do totals[i] = 0 end
  local fields, index, k = {}, {}, 0
  local rolled_from, seen, minute, born
  if roll then rolled_from, seen, minute, born = roll[1], roll[2], roll[3], roll[4] end
  local s = from_s + 1
  if born and s < rolled_from then s = rolled_from end
  while s <= to_s do
    if rolled_from and s % 60 == 0 and s + 59 <= to_s and s >= rolled_from and s ~= seen and s < minute then
      if s < seen then
        local p = int(s) .. ':m'
        for i = 1, n do
          k = k + 1
          fields[k], index[k] = p .. names[i], i
        end
      end
      s = s + 60
    else
      local p = int(s) .. ':'
      for i = 1, n do
        k = k + 1
        fields[k], index[k] = p .. names[i], i
      end
      s = s + 1
    end
    if k >= 4000 or (s > to_s and k > 0) then
      local values = redis.call('HMGET', stats, unpack(fields, 1, k))
      for i = 1, k do
        local v = values[i]
        if v then totals[index[i]] = totals[index[i]] + tonumber(v) end
      end
      k = 0
    end
  end
  return totals
end

-- One step of the sweep that prune starts when its cursor lags more than an
-- hour: HSCAN from cursor (COUNT 250, so a step touches about 250 fields
-- whatever the hash's size), deleting the counters (and minute totals) of
-- seconds at or before target. upto is the lowest target seen since the sweep began: once the scan
-- ends, every counter at or before it is gone (HSCAN returns every field
-- that is present from its start to its end; no script writes a past second)
-- and the cursor 'pruned' moves to it. Until then the fields 'sweep' (the
-- HSCAN cursor, kept as the string Redis returned) and 'sweep_upto' hold the
-- sweep's progress.
local function sweep_step(stats, cursor, target, upto)
  upto = math.min(upto, target)
  local r = redis.call('HSCAN', stats, cursor, 'COUNT', 250)
  local kv, old = r[2], {}
  for i = 1, #kv, 2 do
    local s = tonumber(string.match(kv[i], '^(%d+):'))
    if s and s <= target then old[#old + 1] = kv[i] end
  end
  if #old > 0 then redis.call('HDEL', stats, unpack(old)) end
  if r[1] == '0' then
    redis.call('HSET', stats, 'pruned', int(upto))
    redis.call('HDEL', stats, 'sweep', 'sweep_upto')
  else
    redis.call('HSET', stats, 'sweep', r[1], 'sweep_upto', int(upto))
  end
end

-- Deletes the counters of seconds that fell out of the retention, at most 16
-- seconds' worth (or one sweep step) per call, and moves the cursor kept in
-- the field 'pruned'. The readers (window, budget) pass the policy's
-- retention, which is kept in the field 'retention' for release: it prunes
-- too (keep_stats), without the state key, so that the hash stops growing
-- when no controller reads it. Until a reader recorded one, the longest
-- retention a policy can have applies: a 1 h window and a minute.
local function prune(stats, now_s, retention)
  local c = redis.call('HMGET', stats, 'pruned', 'retention', 'sweep', 'sweep_upto')
  if retention then
    if tonumber(c[2]) ~= retention then redis.call('HSET', stats, 'retention', int(retention)) end
  else
    retention = tonumber(c[2]) or 3660
  end
  local target = now_s - retention
  if c[3] then
    sweep_step(stats, c[3], target, tonumber(c[4]) or target)
    return
  end
  local cursor = tonumber(c[1]) or (target - 1)
  if cursor >= target then return end
  if cursor < target - 3600 then
    -- Far behind (nobody pruned for an hour): 16 seconds a call would never
    -- catch up, and one pass over the whole hash would block Redis for as
    -- long as the hash is large. Sweep it in steps instead.
    sweep_step(stats, '0', target, target)
    return
  end
  local upto = math.min(target, cursor + 16)
  local fields = {}
  for s = cursor + 1, upto do
    for _, f in ipairs(suffixes()) do fields[#fields + 1] = int(s) .. ':' .. f end
    if s % 60 == 0 then
      for _, f in ipairs(suffixes()) do fields[#fields + 1] = int(s) .. ':m' .. f end
    end
  end
  redis.call('HDEL', stats, unpack(fields))
  redis.call('HSET', stats, 'pruned', int(upto))
end

-- Writes the minute totals '<m>:m<suffix>' of minute m (its first second),
-- for the counters that are not zero.
local function roll_minute(stats, m)
  local names = suffixes()
  local totals = sum(stats, m - 1, m + 59, names)
  local kv = {}
  for i = 1, #names do
    if totals[i] ~= 0 then
      kv[#kv + 1] = int(m) .. ':m' .. names[i]
      kv[#kv + 1] = int(totals[i])
    end
  end
  if #kv > 0 then redis.call('HSET', stats, unpack(kv)) end
end

-- Sets the stats hash's expiry and its 'encoding' field; given the current
-- second, also keeps the minute totals and, unless pruned is true, prunes.
--
-- The hash holds one field per counter and second, hundreds of them. Redis
-- keeps a small hash as a listpack (up to hash-max-listpack-entries fields),
-- where every field lookup scans the whole hash: reading a minute's counters
-- then costs hundreds of microseconds. A value longer than
-- hash-max-listpack-value (64 bytes by default) turns it into a hash table for
-- good, with O(1) lookups; the field 'encoding' holds such a value. Every
-- script that counts calls this when it may have created the hash.
--
-- release and budget call it with now_s on the first count of a counter in a
-- second, so it runs in every second that has counters. 'seen' is the minute
-- (first second) of the last such call: the first call in a new minute
-- writes the totals of minute 'seen', which is closed, and every minute
-- between it and this one had no counters. 'rolled_from' is the minute of
-- the first call: from it up to 'seen' (excluded) every minute has its
-- totals or no counters, which lets sum read an hour in 60 fields per
-- counter instead of 3600. 'born' says that the hash had no counters before
-- 'rolled_from' either (see born()): a young hash's hour costs no more.
--
-- release prunes here because the expiry it refreshes every second would
-- otherwise keep a hash that nobody prunes alive, and growing, for as long
-- as workers report with no controller.
local function keep_stats(stats, now_s, pruned)
  redis.call('EXPIRE', stats, 3720)
  redis.call('HSETNX', stats, 'encoding',
    'hashtable: this value is longer than 64 bytes so that Redis keeps a hash table')
  if not now_s then return end
  local minute = now_s - now_s % 60
  local r = redis.call('HMGET', stats, 'seen', 'rolled_from')
  local seen = tonumber(r[1])
  if seen ~= minute then
    if seen and tonumber(r[2]) and seen < minute then
      roll_minute(stats, seen)
      redis.call('HSET', stats, 'seen', int(minute))
    elseif not seen and redis.call('HLEN', stats) <= 2 then
      -- The first report made the hash: this count and 'encoding'.
      redis.call('HSET', stats, 'seen', int(minute), 'rolled_from', int(minute), 'born', '1')
    else
      -- The first report into a hash that has counters (written by hand),
      -- or the clock went back: start afresh, claiming nothing before.
      redis.call('HSET', stats, 'seen', int(minute), 'rolled_from', int(minute))
      redis.call('HDEL', stats, 'born')
    end
  end
  if not pruned then prune(stats, now_s) end
end

-- Called by window and budget before they write: when the stats hash does
-- not exist yet, it has no counters, so it is marked born at this minute
-- (keep_stats) and sums never read the seconds before it.
local function born(stats, now_s)
  if redis.call('EXISTS', stats) == 0 then
    local minute = int(now_s - now_s % 60)
    redis.call('HSET', stats, 'seen', minute, 'rolled_from', minute, 'born', '1')
  end
end

-- The names of the fields that cache the totals of tag ('budget', 'window'):
-- <tag>_upto, <tag>_from, rolled_from, seen, born (keep_stats), then
-- <tag>_<name> for each name; appended to fields, which is returned.
local function cache_fields(tag, names, fields)
  fields[#fields + 1] = tag .. '_upto'
  fields[#fields + 1] = tag .. '_from'
  fields[#fields + 1] = 'rolled_from'
  fields[#fields + 1] = 'seen'
  fields[#fields + 1] = 'born'
  for i = 1, #names do fields[#fields + 1] = tag .. '_' .. names[i] end
  return fields
end

-- Totals of the counters named by names over the closed seconds
-- (from_s, now_s - 1]; from_s is now_s - length for a sliding window, or a
-- transition's second, which stays put while the window grows up to its
-- length. Counters are only ever added to the current second, so these
-- totals are cached in the stats hash (cache_fields: computed over (f, u])
-- and moved forward: the seconds (u, now_s - 1] are added and (f, from_s]
-- subtracted, so a read costs the seconds that passed since the last one,
-- not the window's length. cached holds the fields of cache_fields as HMGET
-- returned them; every sum reads the minute totals (keep_stats) where it
-- can. The totals are summed afresh when the cache is missing, ahead of the
-- clock or of from_s, either bound more than 50 s behind (the seconds to
-- subtract may be pruned: the retention exceeds every window by 60 s; and a
-- new transition is cheaper summed) or when they come out negative.
local function closed_totals(stats, tag, names, from_s, now_s, cached)
  local n = #names
  local last = now_s - 1
  if from_s > last then from_s = last end -- no closed second: an empty range
  local upto, from = tonumber(cached[1]), tonumber(cached[2])
  local roll
  if tonumber(cached[3]) and tonumber(cached[4]) then
    roll = {tonumber(cached[3]), tonumber(cached[4]), now_s - now_s % 60, cached[5] == '1'}
  end
  local totals
  if upto and from and upto <= last and from <= from_s and last - upto <= 50 and from_s - from <= 50 then
    totals = {}
    for i = 1, n do totals[i] = tonumber(cached[5 + i]) or -1 end
    if upto < last then
      local add = sum(stats, upto, last, names, roll)
      for i = 1, n do totals[i] = totals[i] + add[i] end
    end
    if from < from_s then
      local drop = sum(stats, from, from_s, names, roll)
      for i = 1, n do totals[i] = totals[i] - drop[i] end
    end
    for i = 1, n do
      if totals[i] < 0 then
        totals = nil
        break
      end
    end
  end
  if not totals then
    totals = sum(stats, from_s, last, names, roll)
    upto = nil
  end
  if upto ~= last or from ~= from_s then
    local kv = {tag .. '_upto', int(last), tag .. '_from', int(from_s)}
    for i = 1, n do
      kv[#kv + 1] = tag .. '_' .. names[i]
      kv[#kv + 1] = int(totals[i])
    end
    redis.call('HSET', stats, unpack(kv))
    keep_stats(stats)
  end
  return totals
end

-- The dead-man rule: an Open or HalfOpen that no manager has published for
-- stale_after_ms (the manager is dead, unschedulable or partitioned from
-- Redis) is stale: acquire and pool admit the policy's probes, at most
-- half_open_probes calls in flight, until a manager publishes again. The
-- fleet then trickles at the probe rate instead of refusing every call for
-- as long as the manager is gone (Open), or once the epoch's probes are
-- spent (HalfOpen: nobody reads their outcomes to start the next epoch).
-- state, updated and stale_after are the state hash's fields as read.
local function dead_man(state, updated, stale_after, now_ms)
  if state ~= 'Open' and state ~= 'HalfOpen' then return false end
  local after, at = tonumber(stale_after) or 0, tonumber(updated)
  return after > 0 and at ~= nil and now_ms > at + after
end

-- The in-path trip: a Closed or Ramping breaker opens as the workers report
-- the failures that cross its rule, without waiting for the controller's next
-- evaluation. Called with the current second's counters already counted,
-- after an outcome f or t of a call that is not a probe (release), or after
-- an aggregated report that holds one. The rule is internal/breaker's
-- Config.Trips over the counts window reads: calls = s + f + t and
-- failures = f + t over the seconds (max(now_s - breaker_window_s,
-- floor(trip_since_ms / 1000)), now_s], tripping when calls >=
-- max(trip_min_calls, 1) and failures >= trip_failure_ratio * calls, in
-- doubles as Go's float64 (the ratio is the decimal the controller wrote,
-- which tonumber reads to the same double as Go's ParseFloat). The closed
-- seconds come from cached totals (closed_totals, tag 'trip'), so a call
-- reads one HMGET of the state and one of the stats, plus the seconds that
-- passed since the last one.
--
-- A trip writes state Open, limit 0, open_until_ms = now + trip_open_ms,
-- tripped_at_ms = now, tripped_from = the state it replaced, and what
-- ends it when no manager takes it over (below): tripped_limit, the limit it
-- replaced, tripped_epoch, the epoch it kept, and tripped_stale_ms, the
-- dead-man bound the manager published. It adds one to trip_count, the
-- counter publish fences with (a clock that steps back after a failover
-- cannot make a new trip look acknowledged), extends stale_after_ms as the
-- controller does for an Open it publishes (the dead-man bound then runs
-- from open_until_ms), and announces '<epoch> Open 0' on the changes channel
-- (announce_change, the format publish uses). It keeps the epoch and seq:
-- the controller takes the trip over at its next evaluation and publishes
-- the next epoch, and publish refuses a plan that did not see the trip
-- (unacknowledged_trip). Returns true when it tripped.
local function open_by_workers(state, epoch, now_ms, open_ms, updated, stale_base, kv)
  kv[#kv + 1] = 'state'
  kv[#kv + 1] = 'Open'
  kv[#kv + 1] = 'limit'
  kv[#kv + 1] = '0'
  kv[#kv + 1] = 'open_until_ms'
  kv[#kv + 1] = int(now_ms + open_ms)
  kv[#kv + 1] = 'tripped_at_ms'
  kv[#kv + 1] = int(now_ms)
  local base, at = tonumber(stale_base) or 0, tonumber(updated)
  if base > 0 and at then
    kv[#kv + 1] = 'stale_after_ms'
    kv[#kv + 1] = int(now_ms - at + base + open_ms)
  end
  redis.call('HSET', state, unpack(kv))
  redis.call('HINCRBY', state, 'trip_count', 1)
  announce_change(state, epoch or '0', 'Open', '0')
end

local function trip(state, stats, now_s, now_ms)
  local st = redis.call('HMGET', state, 'trip_on', 'state', 'epoch', 'trip_failure_ratio',
    'trip_min_calls', 'trip_since_ms', 'breaker_window_s', 'trip_open_ms',
    'updated_at_ms', 'stale_after_ms', 'limit')
  if st[1] ~= '1' or (st[2] ~= 'Closed' and st[2] ~= 'Ramping') then return false end
  local ratio, min_calls = tonumber(st[4]), tonumber(st[5])
  if not ratio or not min_calls then return false end
  local from_s = math.max(now_s - math.floor(tonumber(st[7]) or 0), math.floor((tonumber(st[6]) or 0) / 1000))
  local names = {'s', 'f', 't'}
  local fields = cache_fields('trip', names, {})
  local p = int(now_s) .. ':'
  for i = 1, 3 do fields[#fields + 1] = p .. names[i] end
  local c = redis.call('HMGET', stats, unpack(fields))
  local totals = closed_totals(stats, 'trip', names, from_s, now_s, c)
  if from_s < now_s then
    for i = 1, 3 do totals[i] = totals[i] + (tonumber(c[8 + i]) or 0) end
  end
  local calls, failures = totals[1] + totals[2] + totals[3], totals[2] + totals[3]
  if calls < math.max(min_calls, 1) or not (failures >= ratio * calls) then return false end
  open_by_workers(state, st[3], now_ms, math.floor(tonumber(st[8]) or 0), st[9], st[10],
    {'tripped_from', st[2], 'tripped_limit', st[11] or '0', 'tripped_epoch', st[3] or '0',
     'tripped_stale_ms', st[10] or '0'})
  return true
end

-- A trip that no manager took over ends by itself (docs/protocol.md §4 "A
-- trip that ends by itself"): while the state is still the trip's Open (the
-- epoch is tripped_epoch: a manager of any version that takes a trip over
-- publishes the next epoch) and the dead-man bound the manager published
-- (tripped_stale_ms) has passed since open_until_ms, as it would for an Open
-- the manager published, the workers probe the dependency as a manager's
-- HalfOpen would. acquire admits half_open_probes probe calls in all,
-- answering HalfOpen with the epoch; release counts their outcomes in the
-- probes hash (orphan_verdict). A failure or timeout opens the breaker again
-- for trip_open_ms; as many successes as half_open_probes put back the state
-- and limit the trip replaced, acknowledge the trip (trip_acked_ms,
-- trip_acked_count), and start the trip rule's window afresh
-- (trip_since_ms). Probes admitted but never answered (their worker died)
-- give way to a new round once trip_open_ms has passed since the round began
-- (orphan_round).
local function orphan_start(open_until, stale)
  return (tonumber(open_until) or 0) + math.max(0, tonumber(stale) or 0)
end

local function orphan_trip(state, epoch, tripped_epoch, open_until, stale, now_ms)
  return state == 'Open' and tripped_epoch and tripped_epoch == epoch and
    now_ms >= orphan_start(open_until, stale)
end

-- The orphan trip's probes of this round are spent: when a whole
-- trip_open_ms has passed since the round began (the later of the orphan's
-- start and tripped_round_ms) without a verdict, a new round begins now:
-- the probes hash is emptied and tripped_round_ms set to now. Returns true
-- when it did.
local function orphan_round(state, probes, open_until, stale, now_ms)
  local r = redis.call('HMGET', state, 'trip_open_ms', 'tripped_round_ms')
  local began = math.max(orphan_start(open_until, stale), tonumber(r[2]) or 0)
  if now_ms < began + (tonumber(r[1]) or 0) then return false end
  redis.call('DEL', probes)
  redis.call('HSET', state, 'tripped_round_ms', int(now_ms))
  return true
end

-- The verdict on an orphan trip's probe whose outcome (s, f or t) release
-- just counted in the probes hash.
local function orphan_verdict(state, probes, outcome, now_ms)
  local st = redis.call('HMGET', state, 'epoch', 'tripped_from', 'tripped_limit',
    'tripped_at_ms', 'trip_count', 'half_open_probes', 'trip_open_ms', 'updated_at_ms',
    'tripped_stale_ms')
  if outcome == 'f' or outcome == 't' then
    redis.call('DEL', probes)
    open_by_workers(state, st[1], now_ms, math.floor(tonumber(st[7]) or 0), st[8], st[9], {})
    return
  end
  local ok = tonumber(redis.call('HGET', probes, 's')) or 0
  if ok < math.max(1, math.floor(tonumber(st[6]) or 1)) then return end
  local to, limit = st[2] or 'Closed', st[3] or '0'
  redis.call('DEL', probes)
  redis.call('HSET', state, 'state', to, 'limit', limit, 'open_until_ms', '0',
    'trip_since_ms', int(now_ms), 'trip_acked_ms', st[4] or '0', 'trip_acked_count', int(tonumber(st[5]) or 0),
    'stale_after_ms', st[9] or '0')
  announce_change(state, st[1] or '0', to, limit)
end

-- The stored trip that a publication does not acknowledge: trip_count is
-- above the publication's trip_acked_count (absent: 0), or tripped_at_ms is
-- after its trip_acked_ms (absent: 0; a trip by a worker of version 4, which
-- does not count trips, is seen only so). Such a plan was made from a state
-- read before the trip, and would undo it (publish a Closed the trip ended);
-- publish refuses it, and the controller plans again from the tripped state.
-- Returns tripped_at_ms (0 if absent), or nil when the publication may
-- proceed.
local function unacknowledged_trip(state, argv)
  local r = redis.call('HMGET', state, 'tripped_at_ms', 'trip_count')
  local tripped, count = tonumber(r[1]), tonumber(r[2]) or 0
  if not tripped and count == 0 then return nil end
  local acked, acked_count = 0, 0
  for i = 3, #argv - 1, 2 do
    if argv[i] == 'trip_acked_ms' then acked = tonumber(argv[i + 1]) or 0
    elseif argv[i] == 'trip_acked_count' then acked_count = tonumber(argv[i + 1]) or 0 end
  end
  if count > acked_count or (tripped and tripped > acked) then return tripped or 0 end
  return nil
end
