-- supersede: record that version ARGV[1] of a job key exists, so older versions
-- are dropped before they call the dependency.
-- KEYS[1] job  ARGV[1] version  ARGV[2] ttl ms
-- Returns the newest version known.
local cur = redis.call('GET', KEYS[1])
if cur and tonumber(cur) >= tonumber(ARGV[1]) then return cur end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return ARGV[1]
