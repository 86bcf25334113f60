-- acquire: admit one call, or say why not.
-- KEYS[1] state  KEYS[2] leases  KEYS[3] gcra  KEYS[4] probes  [KEYS[5] job]
-- ARGV[1] lease id  ARGV[2] lease ttl ms  [ARGV[3] job version  ARGV[4] job ttl ms]
-- Returns {code, ...}: 0 admitted {0, epoch, limit, state}, the lease member
-- being '<epoch>:<lease id>'; 1 open {1, ms until probes}; 2 throttled {2, ms
-- until the first lease expires, held, limit}; 3 rate {3, ms to wait};
-- 4 superseded {4, newest version}; 5 no policy {5}; 6 protocol version
-- mismatch {6, version}.
local st = redis.call('HMGET', KEYS[1], 'version', 'state', 'limit', 'epoch',
  'rate_interval_us', 'rate_burst', 'open_until_ms')
if not st[1] then return {5} end
if st[1] ~= '2' then return {6, tonumber(st[1]) or -1} end

local now = now_us()
local now_ms = math.floor(now / 1000)

if KEYS[5] then
  local newest = redis.call('GET', KEYS[5])
  if newest and tonumber(newest) > tonumber(ARGV[3]) then return {4, newest} end
end

if st[2] == 'Open' then
  local until_ms = tonumber(st[7]) or now_ms
  return {1, math.max(0, until_ms - now_ms)}
end

-- Live leases are those that expire after now. Expired ones no longer count;
-- they are swept here only when the call is refused (the admission path
-- stays at one sorted-set read and one write), and by window. The sweep
-- spares the encoding member, scored -inf (see the ZADD below).
local limit = math.floor(tonumber(st[3]) or 0)
local now_key = int(now_ms)
local held = redis.call('ZCOUNT', KEYS[2], '(' .. now_key, '+inf')
if held >= limit then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '(-inf', now_key)
  local first = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. now_key, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  local wait = 0
  if first[2] then wait = tonumber(first[2]) - now_ms end
  return {2, wait, held, limit}
end

-- HalfOpen admits `limit` probe calls per epoch in all, not `limit` at a
-- time: a probe that fails fast must not make room for the next one before
-- the controller has seen the failure. A new epoch clears the probes hash.
local probing = st[2] == 'HalfOpen'
if probing and (tonumber(redis.call('HGET', KEYS[4], 'admitted')) or 0) >= limit then
  return {2, 0, held, limit}
end

local interval = math.floor(tonumber(st[5]) or 0)
if interval > 0 then
  local burst = math.max(1, math.floor(tonumber(st[6]) or 1))
  local tat = tonumber(redis.call('GET', KEYS[3])) or now
  if tat < now then tat = now end
  local allow_at = tat - (burst - 1) * interval
  if allow_at > now then return {3, math.ceil((allow_at - now) / 1000)} end
  local next_tat = tat + interval
  redis.call('SET', KEYS[3], int(next_tat), 'PX', int(math.ceil((next_tat - now) / 1000) + 1000))
end

if probing then redis.call('HINCRBY', KEYS[4], 'admitted', 1) end
-- With no live lease the set may be new: the same ZADD then adds the member
-- 'encoding:…', scored -inf so that it never counts, whose name is longer
-- than zset-max-listpack-value (64 bytes by default). Redis then keeps the
-- set as a skiplist, where ZCOUNT, ZADD and ZREM are O(log n), instead of a
-- listpack of up to 128 leases that each of them scans.
local expiry = int(now_ms + tonumber(ARGV[2]))
if held == 0 then
  redis.call('ZADD', KEYS[2], '-inf',
    'encoding: this member is longer than 64 bytes so that Redis keeps a skiplist',
    expiry, st[4] .. ':' .. ARGV[1])
else
  redis.call('ZADD', KEYS[2], expiry, st[4] .. ':' .. ARGV[1])
end
if KEYS[5] then
  redis.call('SET', KEYS[5], ARGV[3], 'PX', ARGV[4])
end
return {0, tonumber(st[4]), limit, st[2]}
