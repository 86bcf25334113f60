-- acquire: admit one call, or say why not.
-- KEYS[1] state  KEYS[2] leases  KEYS[3] gcra  KEYS[4] probes  KEYS[5] wants
-- KEYS[6] callers  [KEYS[7] job]
-- ARGV[1] lease id  ARGV[2] lease ttl ms  ARGV[3] deadline ms (Redis time, 0
-- for none)  [ARGV[4] job version  ARGV[5] job ttl ms (both '' without a
-- job key)  [ARGV[6] caller id ('' or absent: an anonymous caller)]]
-- Returns {code, ..., now ms}: 0 admitted {0, epoch, limit, state, now}, the
-- lease member being the lease id; 1 open {1, ms until probes, now}; 2
-- throttled {2, ms until the first lease expires, held, limit, now}; 3 rate
-- {3, ms to wait, now}, 2 also while the dependency learns (lib.lua
-- learning: {2, ms of learning left, held, limit, now}); 4 superseded {4, newest version, now}; 5 no policy
-- {5}; 6 a state of a protocol version these scripts do not act on {6,
-- state version, manager version} (lib.lua version_refusal); 7 late {7, now}.
-- Idempotent per lease id: run again with the id of a lease it admitted (a
-- client's resend after a lost reply), it answers admitted again and writes
-- nothing; the epoch is then 0 if the lease was not a probe of the current
-- HalfOpen epoch (see below).
local now = now_us()
local now_ms = math.floor(now / 1000)

-- A request that reaches Redis after its deadline was queued (behind a slow
-- script, in the socket of a paused server) while its caller gave up on the
-- reply: it must take nothing, or its lease would hold a slot that no call
-- uses for the whole lease ttl.
local deadline = tonumber(ARGV[3]) or 0

local st = redis.call('HMGET', KEYS[1], 'version', 'state', 'limit', 'epoch',
  'rate_interval_us', 'rate_burst', 'open_until_ms', 'updated_at_ms',
  'stale_after_ms', 'half_open_probes', 'tripped_epoch', 'tripped_stale_ms',
  'replid', 'learn_until_ms', 'replid_at_ms')
if not st[1] then return {5} end
local refused = version_refusal(KEYS[1], st[1], 6)
if refused then return refused end
-- A trip that no manager took over is probed by the workers once its
-- open_until_ms and the dead-man bound have passed, as a manager's HalfOpen
-- would be (lib.lua orphan_trip): the probes answer HalfOpen with the epoch.
local orphan = orphan_trip(st[2], st[4], st[11], st[7], st[12], now_ms)

-- A resend: the client sent this lease id before, Redis admitted it and the
-- reply was lost (a connection closed after the script ran), and the client
-- library sent the same command again. It is answered as the first run was
-- answered, writing nothing and counting nothing: checked before the
-- deadline, the breaker, the job key, the slots and the rate, any of which
-- would refuse it now and leave the lease held by no call. The epoch, limit
-- and state are those in force now, which are the first run's unless a
-- publish landed between the two runs; a lease that was a probe of the
-- current HalfOpen epoch is marked in the probes hash (below), and a live
-- lease that was not answers epoch 0 while HalfOpen, so that it is never
-- reported as a probe of an epoch that did not admit it. A lease that is
-- there but expired (forgotten, or past its ttl) is not revived: it takes
-- the normal path, whose ZADD NX leaves it expired.
local own = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[1]))
if own and own > now_ms then
  local limit, epoch, answer = math.floor(tonumber(st[3]) or 0), tonumber(st[4]), st[2]
  if not orphan and dead_man(st[2], st[8], st[9], now_ms) then
    -- the dead-man rule's admission answers Open (below): never a probe
    limit, answer = math.floor(tonumber(st[10]) or 1), 'Open'
  elseif (st[2] == 'HalfOpen' or orphan) and redis.call('HEXISTS', KEYS[4], 'lease:' .. ARGV[1]) == 0 then
    epoch = 0
  elseif orphan then
    limit, answer = math.floor(tonumber(st[10]) or 1), 'HalfOpen'
  end
  return {0, epoch, limit, answer, now_ms}
end

if deadline > 0 and now_ms > deadline then return {7, now_ms} end

if KEYS[7] then
  local newest = redis.call('GET', KEYS[7])
  if newest and tonumber(newest) > tonumber(ARGV[4]) then return {4, newest, now_ms} end
end

local state = st[2]
local limit = math.floor(tonumber(st[3]) or 0)
-- The dead-man rule (lib.lua dead_man); an orphan trip's probes come first.
local stale = not orphan and dead_man(state, st[8], st[9], now_ms)
if orphan then
  limit = math.floor(tonumber(st[10]) or 1)
  state = 'HalfOpen'
elseif stale then
  limit = math.floor(tonumber(st[10]) or 1)
  state = 'Stale'
elseif state == 'Open' then
  local until_ms = tonumber(st[7]) or now_ms
  return {1, math.max(0, until_ms - now_ms), now_ms}
end

local now_key = int(now_ms)
local probing = state == 'HalfOpen'
local held = 0
if probing then
  -- HalfOpen admits `limit` probe calls per epoch in all, not `limit` at a
  -- time: a probe that fails fast must not make room for the next one before
  -- the controller has seen the failure. A new epoch clears the probes hash.
  -- Leases of earlier epochs (calls admitted before the outage that still
  -- run) do not count: they would keep the probes out until they end.
  if (tonumber(redis.call('HGET', KEYS[4], 'admitted')) or 0) >= limit and
      not (orphan and orphan_round(KEYS[1], KEYS[4], st[7], st[12], now_ms)) then
    return {2, 0, 0, limit, now_ms}
  end
else
  -- Live leases are those that expire after now. Expired ones no longer
  -- count; they are swept here only when the call is refused (the admission
  -- path stays at one sorted-set read and one write), and by window. The
  -- sweep spares the encoding member, scored -inf (see the ZADD below).
  held = redis.call('ZCOUNT', KEYS[2], '(' .. now_key, '+inf')
  if held >= limit then
    -- Per-call demand: batching pools (pool.lua) count each caller refused
    -- within the last second as one contender for a fair share, and give
    -- back idle slots above their share. A caller that names itself is
    -- scored in the callers set, which keeps only the last second (pruned
    -- here, so that pool.lua counts the live callers with one ZCOUNT); the
    -- anonymous ones together are one contender, the field 'percall'.
    local caller = ARGV[6]
    if caller and caller ~= '' then
      redis.call('ZADD', KEYS[6], now_key, caller)
      redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', '(' .. int(now_ms - 1000))
      redis.call('PEXPIRE', KEYS[6], 2000)
    else
      redis.call('HSET', KEYS[5], 'percall', now_key)
    end
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '(-inf', now_key)
    local first = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. now_key, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    local wait = 0
    if first[2] then wait = tonumber(first[2]) - now_ms end
    return {2, wait, held, limit, now_ms}
  end
end

-- Redis may have lost leases whose calls still run: nothing new is admitted
-- until their holders put them back (lib.lua learning). Checked last, on
-- the way to an admission only.
local learn = learning(KEYS[1], st[13], st[14], st[15], now_ms)
if learn > 0 then return {2, learn, held, limit, now_ms} end

local interval = math.floor(tonumber(st[5]) or 0)
if interval > 0 then
  local burst = math.max(1, math.floor(tonumber(st[6]) or 1))
  local tat = tonumber(redis.call('GET', KEYS[3])) or now
  if tat < now then tat = now end
  local allow_at = tat - (burst - 1) * interval
  if allow_at > now then return {3, math.ceil((allow_at - now) / 1000), now_ms} end
  local next_tat = tat + interval
  redis.call('SET', KEYS[3], int(next_tat), 'PX', int(math.ceil((next_tat - now) / 1000) + 1000))
end

if probing then
  -- The marker lets a resend of this acquisition answer as a probe (above);
  -- a new epoch deletes the hash, markers included.
  redis.call('HINCRBY', KEYS[4], 'admitted', 1)
  redis.call('HSET', KEYS[4], 'lease:' .. ARGV[1], '1')
end
-- The ZADD is NX: a lease forgotten before its acquisition ran (forget.lua)
-- stays expired. With no live lease the set may be new: the same ZADD then
-- adds the member 'encoding:…', scored -inf so that it never counts, whose
-- name is longer than zset-max-listpack-value (64 bytes by default). Redis
-- then keeps the set as a skiplist, where ZCOUNT, ZADD and ZREM are
-- O(log n), instead of a listpack of up to 128 leases that each of them
-- scans.
local expiry = int(now_ms + tonumber(ARGV[2]))
if held == 0 then
  redis.call('ZADD', KEYS[2], 'NX', '-inf',
    'encoding: this member is longer than 64 bytes so that Redis keeps a skiplist',
    expiry, ARGV[1])
else
  redis.call('ZADD', KEYS[2], 'NX', expiry, ARGV[1])
end
if KEYS[7] then
  redis.call('SET', KEYS[7], ARGV[4], 'PX', ARGV[5])
end
-- A call the dead-man rule admitted answers Open, a stale HalfOpen's too: it
-- is not a probe (probes.admitted did not count it), and clients pass the
-- epoch to release, which counts probes, only for a HalfOpen answer.
local admitted_as = st[2]
if stale then admitted_as = 'Open' elseif orphan then admitted_as = 'HalfOpen' end
return {0, tonumber(st[4]), limit, admitted_as, now_ms}
