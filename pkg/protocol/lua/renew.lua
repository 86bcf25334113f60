-- renew: extend a lease that is still held; never re-acquire a lost one.
-- KEYS[1] leases  [KEYS[2] state  KEYS[3] released]
-- ARGV[1] member  ARGV[2] ttl ms
-- Returns 1 when renewed, 0 when the lease had expired or was never held.
-- A lease that is missing (not expired: not there at all) is put back when
-- Redis may have lost it (lib.lua learning): while the dependency learns,
-- and when no state is stored (Redis lost it all; nobody admits without
-- one). It is then renewed, 1, unless it was released (lib.lua
-- remember_released): this renewal was sent before its call ended.
local now_ms = math.floor(now_us() / 1000)
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not expiry and KEYS[2] then
  local st = redis.call('HMGET', KEYS[2], 'version', 'replid', 'learn_until_ms', 'replid_at_ms')
  if not st[1] or learning(KEYS[2], st[2], st[3], st[4], now_ms) > 0 then
    if relearn(KEYS[1], {ARGV[1]}, now_ms + tonumber(ARGV[2]), KEYS[3], now_ms) == 1 then return 1 end
    return 0
  end
end
if not expiry or tonumber(expiry) <= now_ms then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 0
end
redis.call('ZADD', KEYS[1], 'XX', int(now_ms + tonumber(ARGV[2])), ARGV[1])
return 1
