-- release: free a lease and report the call's outcome, in one round trip.
-- KEYS[1] state  KEYS[2] leases  KEYS[3] stats  KEYS[4] probes
-- ARGV[1] member (or '' for a call admitted without a lease)  ARGV[2] outcome
-- s|f|t  ARGV[3] attempt (>= 1)  ARGV[4] the epoch that admitted the call
-- Returns 1 when the lease was still held, 0 when it had expired.
local held = 0
if ARGV[1] ~= '' then held = redis.call('ZREM', KEYS[2], ARGV[1]) end
local st = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'stats_retention_s')
local now_s = math.floor(now_us() / 1000000)
local retention = math.floor(tonumber(st[3]) or 3660)
local attempt = math.floor(tonumber(ARGV[3]))
if attempt > 4 then attempt = 4 end
if attempt < 1 then attempt = 1 end
local p = int(now_s) .. ':'
redis.call('HINCRBY', KEYS[3], p .. 'c', 1)
redis.call('HINCRBY', KEYS[3], p .. ARGV[2], 1)
redis.call('HINCRBY', KEYS[3], p .. 'a' .. attempt, 1)
prune(KEYS[3], now_s, retention)
redis.call('EXPIRE', KEYS[3], int(retention + 60))
if st[1] == 'HalfOpen' and st[2] == ARGV[4] then
  redis.call('HINCRBY', KEYS[4], ARGV[2], 1)
end
return held
