-- budget: may this failed job retry now? Counts the grant or the refusal.
-- KEYS[1] state  KEYS[2] stats
-- Returns {allowed 0|1, backoff base ms, backoff max ms, jitter, calls, granted}
-- or {-5} when no policy is published. The rule is retry.AllowsPPM:
-- granted × 1e6 < max(minRetries × 1e6, ratioPPM × calls) over the window.
local st = redis.call('HMGET', KEYS[1], 'version', 'budget_ratio_ppm',
  'budget_min_retries', 'budget_window_s', 'backoff_base_ms', 'backoff_max_ms',
  'jitter', 'stats_retention_s')
if not st[1] then return {-5} end
if st[1] ~= '2' then return {-6} end
local now_s = math.floor(now_us() / 1000000)
local window = math.floor(tonumber(st[4]))
local names = {'s', 'f', 't', 'g'}

-- The window is (now_s - window, now_s]. Counters are only ever added to the
-- current second, so the totals of the closed seconds, up to now_s - 1, are
-- kept in the hash (budget_upto, budget_window, budget_calls,
-- budget_granted) and moved forward: a decision reads them and the current
-- second in one HMGET, and once per second adds the seconds that entered the
-- window and subtracts those that left. A cache more than 50 s behind (its
-- oldest seconds may be pruned), of another window, ahead of the clock or
-- negative is rebuilt from the per-second counters.
local p = int(now_s) .. ':'
local c = redis.call('HMGET', KEYS[2], 'budget_upto', 'budget_window',
  'budget_calls', 'budget_granted', p .. 's', p .. 'f', p .. 't', p .. 'g')
local last = now_s - 1
local upto = tonumber(c[1])
local calls, granted
if upto and tonumber(c[2]) == window and upto <= last and last - upto <= 50 then
  calls, granted = tonumber(c[3]) or -1, tonumber(c[4]) or -1
  if upto < last then
    local add = sum(KEYS[2], upto, last, names)
    local drop = sum(KEYS[2], upto - window + 1, last - window + 1, names)
    calls = calls + add[1] + add[2] + add[3] - drop[1] - drop[2] - drop[3]
    granted = granted + add[4] - drop[4]
  end
end
if not calls or calls < 0 or granted < 0 then
  local t = sum(KEYS[2], now_s - window, last, names)
  calls, granted, upto = t[1] + t[2] + t[3], t[4], nil
end
if upto ~= last then
  redis.call('HSET', KEYS[2], 'budget_upto', int(last), 'budget_window', int(window),
    'budget_calls', int(calls), 'budget_granted', int(granted))
end
prune(KEYS[2], now_s, math.floor(tonumber(st[8]) or 3660))
calls = calls + (tonumber(c[5]) or 0) + (tonumber(c[6]) or 0) + (tonumber(c[7]) or 0)
granted = granted + (tonumber(c[8]) or 0)

local ratio_ppm = math.floor(tonumber(st[2]))
local min_retries = math.floor(tonumber(st[3]))
local allowed = granted * 1000000 < math.max(min_retries * 1000000, ratio_ppm * calls)
if redis.call('HINCRBY', KEYS[2], p .. (allowed and 'g' or 'b'), 1) == 1 then
  keep_stats(KEYS[2])
end
return {allowed and 1 or 0, tonumber(st[5]), tonumber(st[6]), st[7], calls, granted}
