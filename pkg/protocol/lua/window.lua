-- window: what the controller reads each evaluation; it also prunes counters
-- older than the retention and sweeps expired leases.
-- KEYS[1] state  KEYS[2] stats  KEYS[3] probes  KEYS[4] leases
-- ARGV[1] window seconds  ARGV[2] count only seconds after this unix second
-- Returns {now ms, calls, successes, failures, timeouts, a1, a2, a3, a4,
-- retries granted, budget refusals, probe successes, probe failures, probe timeouts}.
local now = now_us()
local now_s = math.floor(now / 1000000)
local from_s = math.max(now_s - math.floor(tonumber(ARGV[1])), math.floor(tonumber(ARGV[2])))
local totals = sum(KEYS[2], from_s, now_s, suffixes())
local retention = tonumber(redis.call('HGET', KEYS[1], 'stats_retention_s'))
if retention then prune(KEYS[2], now_s, math.floor(retention)) end
redis.call('ZREMRANGEBYSCORE', KEYS[4], '(-inf', int(math.floor(now / 1000)))
local probes = redis.call('HMGET', KEYS[3], 's', 'f', 't')
local reply = {math.floor(now / 1000), totals[1] + totals[2] + totals[3]}
for _, v in ipairs(totals) do reply[#reply + 1] = v end
for _, v in ipairs(probes) do reply[#reply + 1] = tonumber(v) or 0 end
return reply
