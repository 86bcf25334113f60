-- budget: may this failed job retry now? Counts the grant or the refusal.
-- KEYS[1] state  KEYS[2] stats
-- Returns {allowed 0|1, backoff base ms, backoff max ms, jitter, calls, granted}
-- or {-5} when no policy is published. The rule is retry.AllowsPPM:
-- granted × 1e6 < max(minRetries × 1e6, ratioPPM × calls) over the window.
local st = redis.call('HMGET', KEYS[1], 'version', 'budget_ratio_ppm',
  'budget_min_retries', 'budget_window_s', 'backoff_base_ms', 'backoff_max_ms',
  'jitter', 'stats_retention_s')
if not st[1] then return {-5} end
if st[1] ~= '4' then return {-6} end
local now_s = math.floor(now_us() / 1000000)
local window = math.floor(tonumber(st[4]))
local names = {'s', 'f', 't', 'g'}

-- The window is (now_s - window, now_s]: the cached totals of its closed
-- seconds (lib.lua closed_totals) and the current second, read in one HMGET.
born(KEYS[2], now_s)
local p = int(now_s) .. ':'
local fields = cache_fields('budget', names, {})
for i = 1, #names do fields[#fields + 1] = p .. names[i] end
local c = redis.call('HMGET', KEYS[2], unpack(fields))
local t = closed_totals(KEYS[2], 'budget', names, now_s - window, now_s, c)
local k = 5 + #names
local calls = t[1] + t[2] + t[3] + (tonumber(c[k + 1]) or 0) + (tonumber(c[k + 2]) or 0) + (tonumber(c[k + 3]) or 0)
local granted = t[4] + (tonumber(c[k + 4]) or 0)
prune(KEYS[2], now_s, math.floor(tonumber(st[8]) or 3660))

local ratio_ppm = math.floor(tonumber(st[2]))
local min_retries = math.floor(tonumber(st[3]))
local allowed = granted * 1000000 < math.max(min_retries * 1000000, ratio_ppm * calls)
if redis.call('HINCRBY', KEYS[2], p .. (allowed and 'g' or 'b'), 1) == 1 then
  keep_stats(KEYS[2], now_s, true) -- pruned above
end
return {allowed and 1 or 0, tonumber(st[5]), tonumber(st[6]), st[7], calls, granted}
