-- renew: extend a lease that is still held; never re-acquire a lost one.
-- KEYS[1] leases  ARGV[1] member  ARGV[2] ttl ms
-- Returns 1 when renewed, 0 when the lease had expired or was never held.
local now_ms = math.floor(now_us() / 1000)
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not expiry or tonumber(expiry) <= now_ms then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 0
end
redis.call('ZADD', KEYS[1], 'XX', int(now_ms + tonumber(ARGV[2])), ARGV[1])
return 1
