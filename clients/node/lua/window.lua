-- window: what the controller reads each evaluation; it also prunes counters
-- older than the retention and sweeps expired leases.
-- KEYS[1] state  KEYS[2] stats  KEYS[3] probes  KEYS[4] leases
-- ARGV[1] window seconds  ARGV[2] count only seconds after this unix second
-- Returns {now ms, calls, successes, failures, timeouts, a1, a2, a3, a4,
-- retries granted, budget refusals, timed successes' summed microseconds,
-- timed successes, probe successes, probe failures, probe timeouts}.
local now = now_us()
local now_s = math.floor(now / 1000000)
local length = math.floor(tonumber(ARGV[1]))
local from_s = math.max(now_s - length, math.floor(tonumber(ARGV[2])))
local names = suffixes()
-- The cached totals of the closed seconds (lib.lua closed_totals) and the
-- current second, read in one HMGET. After a transition from_s stays put
-- while the window grows, and the cache moves forward all the same.
born(KEYS[2], now_s)
local p = int(now_s) .. ':'
local fields = cache_fields('window', names, {})
for i = 1, #names do fields[#fields + 1] = p .. names[i] end
local c = redis.call('HMGET', KEYS[2], unpack(fields))
local totals = closed_totals(KEYS[2], 'window', names, from_s, now_s, c)
if from_s < now_s then
  local k = 5 + #names
  for i = 1, #names do totals[i] = totals[i] + (tonumber(c[k + i]) or 0) end
end
local retention = tonumber(redis.call('HGET', KEYS[1], 'stats_retention_s'))
if retention then prune(KEYS[2], now_s, math.floor(retention)) end
redis.call('ZREMRANGEBYSCORE', KEYS[4], '(-inf', int(math.floor(now / 1000)))
local probes = redis.call('HMGET', KEYS[3], 's', 'f', 't')
local reply = {math.floor(now / 1000), totals[1] + totals[2] + totals[3]}
for _, v in ipairs(totals) do reply[#reply + 1] = v end
for _, v in ipairs(probes) do reply[#reply + 1] = tonumber(v) or 0 end
return reply
