-- release: free a lease and report the call's outcome, in one round trip.
-- KEYS[1] leases  KEYS[2] stats  KEYS[3] state  KEYS[4] probes  KEYS[5] calls
-- KEYS[6] released
-- ARGV[1] member (or '' for a call admitted without a lease)  ARGV[2] outcome
-- s|f|t|c  ARGV[3] attempt (>= 1)  [ARGV[4] the epoch that admitted the call,
-- for a call admitted HalfOpen (0 otherwise)]  [ARGV[5] how long the call
-- took, in microseconds: a success's is summed (ds) and counted (dn), so the
-- controller knows the dependency's success latency; absent or negative: not
-- timed]
-- Returns 1 when the member was removed, 0 when it was no longer there.
-- A member that is no longer there counts nothing: no outcome, no attempt,
-- no probe. It was released already (this is a resend of a release whose
-- reply was lost, and the first run counted it), or its lease was lost
-- (renew or a sweep removed it as expired: the fleet stopped counting the
-- call then). A call admitted without a lease ('') cannot be told from its
-- resend and counts every time.
-- A failure or timeout of a call that is not a probe may trip the breaker in
-- the fleet's path (lib.lua trip): the state is read only then, and for a
-- call whose ARGV[4] names an epoch. A client of an earlier revision that
-- passes two keys for a call that is not a probe trips nothing.
-- A probe of a trip that no manager took over (lib.lua orphan_trip) counts
-- as a HalfOpen probe does, and its outcome decides the trip
-- (orphan_verdict). A counted call counts in the calls hash too (KEYS[5],
-- lib.lua count_version), when given.
-- While the dependency learns, or with no state stored, the released lease
-- is recorded (KEYS[6], lib.lua remember_released), removed or not: a hold
-- or a renewal sent before the call ended must not put it back. Finding
-- the learning out reads the state (and, every replid_every_ms, the
-- replication id) as acquire does: a release can be the new master's
-- first script.
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local removed = 0
if ARGV[1] ~= '' then
  removed = redis.call('ZREM', KEYS[1], ARGV[1])
  if KEYS[6] then
    local st = redis.call('HMGET', KEYS[3], 'version', 'replid', 'learn_until_ms', 'replid_at_ms')
    if not st[1] or learning(KEYS[3], st[2], st[3], st[4], now_ms) > 0 then
      remember_released(KEYS[6], ARGV[1], now_ms)
    end
  end
  if removed == 0 then return 0 end
end
local probe, orphan = false, false
if KEYS[4] and ARGV[4] and ARGV[4] ~= '0' then
  local st = redis.call('HMGET', KEYS[3], 'state', 'epoch', 'tripped_epoch', 'open_until_ms',
    'tripped_stale_ms')
  if st[2] == ARGV[4] then
    orphan = orphan_trip(st[1], st[2], st[3], st[4], st[5], now_ms)
    probe = st[1] == 'HalfOpen' or orphan
  end
end
-- A cancelled call (its caller gave up, the worker shut down, the guarded code
-- panicked, the lease was lost) says nothing about the dependency: it is not
-- counted, and a cancelled probe gives its probe back to the epoch.
if ARGV[2] == 'c' then
  if probe and (tonumber(redis.call('HGET', KEYS[4], 'admitted')) or 0) > 0 then
    redis.call('HINCRBY', KEYS[4], 'admitted', -1)
  end
  return removed
end
local attempt = math.floor(tonumber(ARGV[3]))
if attempt > 4 then attempt = 4 end
if attempt < 1 then attempt = 1 end
-- t[1] is the Unix second as Redis printed it: a plain decimal integer.
local p = t[1] .. ':'
-- The first count of an outcome in a second sets the hash's expiry (an
-- abandoned dependency's counters vanish after the longest retention, 1h
-- window + 1 minute, and a minute more) and its encoding field, rolls the
-- last minute's counters into minute totals, and prunes one step, so that the
-- hash stays bounded when no controller reads it (lib.lua keep_stats).
if redis.call('HINCRBY', KEYS[2], p .. ARGV[2], 1) == 1 then keep_stats(KEYS[2], tonumber(t[1])) end
redis.call('HINCRBY', KEYS[2], p .. 'a' .. attempt, 1)
local took = tonumber(ARGV[5])
if ARGV[2] == 's' and took and took >= 0 then
  redis.call('HINCRBY', KEYS[2], p .. 'ds', math.floor(took))
  redis.call('HINCRBY', KEYS[2], p .. 'dn', 1)
end
if KEYS[5] then count_version(KEYS[5], tonumber(t[1]), 1) end
if probe then
  redis.call('HINCRBY', KEYS[4], ARGV[2], 1)
  if orphan then orphan_verdict(KEYS[3], KEYS[4], ARGV[2], now_ms) end
end
if KEYS[3] and not probe and (ARGV[2] == 'f' or ARGV[2] == 't') then
  trip(KEYS[3], KEYS[2], tonumber(t[1]), now_ms)
end
return removed
