-- release: free a lease and report the call's outcome, in one round trip.
-- KEYS[1] state  KEYS[2] leases  KEYS[3] stats  KEYS[4] probes
-- ARGV[1] member (or '' for a call admitted without a lease)  ARGV[2] outcome
-- s|f|t  ARGV[3] attempt (>= 1)  ARGV[4] the epoch that admitted the call, or
-- 0 when it was not admitted HalfOpen (only probes need the check)
-- Returns 1 when the lease was still held, 0 when it had expired.
local now = now_us()
local held = 0
if ARGV[1] ~= '' then
  local expiry = redis.call('ZSCORE', KEYS[2], ARGV[1])
  if expiry then
    redis.call('ZREM', KEYS[2], ARGV[1])
    if tonumber(expiry) > math.floor(now / 1000) then held = 1 end
  end
end
local now_s = math.floor(now / 1000000)
local attempt = math.floor(tonumber(ARGV[3]))
if attempt > 4 then attempt = 4 end
if attempt < 1 then attempt = 1 end
local p = int(now_s) .. ':'
-- The first count of a second sets the hash's expiry: an abandoned dependency's
-- counters vanish after the longest retention (1h window + 1 minute) and a
-- minute more.
if redis.call('HINCRBY', KEYS[3], p .. ARGV[2], 1) == 1 then
  redis.call('EXPIRE', KEYS[3], 3720)
end
redis.call('HINCRBY', KEYS[3], p .. 'a' .. attempt, 1)
if ARGV[4] ~= '0' then
  local st = redis.call('HMGET', KEYS[1], 'state', 'epoch')
  if st[1] == 'HalfOpen' and st[2] == ARGV[4] then
    redis.call('HINCRBY', KEYS[4], ARGV[2], 1)
  end
end
return held
