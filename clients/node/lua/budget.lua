-- budget: may this failed job retry now? Counts the grant or the refusal.
-- KEYS[1] state  KEYS[2] stats  [ARGV[1] n: grant up to n retries at once]
-- Returns {allowed 0|1, backoff base ms, backoff max ms, jitter, calls, granted}
-- (with n: {allowed, …, granted, how many of the n were granted}) or {-5}
-- when no policy is published, {-6, state version, manager version} for a
-- state of a version these scripts do not act on (lib.lua version_refusal).
-- The rule is retry.AllowsPPM:
-- granted × 1e6 < max(minRetries × 1e6, ratioPPM × calls) over the window.
-- n asked at once get what n one-at-a-time decisions would: the grants
-- while granted + i stays under the bound, and the rest refused.
-- How many of n one-at-a-time decisions would grant, the grants before them
-- being granted: those with granted + i < bound / 1e6 (i = 0 … n-1). c is
-- the least count with c × 1e6 >= bound; the division's rounding is
-- corrected with exact products (below 2^53).
local function budget_grants(granted, bound, n)
  local c = math.ceil(bound / 1000000)
  if (c - 1) * 1000000 >= bound then c = c - 1 end
  if c * 1000000 < bound then c = c + 1 end
  return math.max(0, math.min(n, c - granted))
end

local st = redis.call('HMGET', KEYS[1], 'version', 'budget_ratio_ppm',
  'budget_min_retries', 'budget_window_s', 'backoff_base_ms', 'backoff_max_ms',
  'jitter', 'stats_retention_s')
if not st[1] then return {-5} end
local refused = version_refusal(KEYS[1], st[1], -6)
if refused then return refused end
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
local bound = math.max(min_retries * 1000000, ratio_ppm * calls)
local n = tonumber(ARGV[1])
if not n then
  local allowed = granted * 1000000 < bound
  if redis.call('HINCRBY', KEYS[2], p .. (allowed and 'g' or 'b'), 1) == 1 then
    keep_stats(KEYS[2], now_s, true) -- pruned above
  end
  return {allowed and 1 or 0, tonumber(st[5]), tonumber(st[6]), st[7], calls, granted}
end
n = math.max(1, math.floor(n))
local grants = budget_grants(granted, bound, n)
local fresh = false
if grants > 0 then fresh = redis.call('HINCRBY', KEYS[2], p .. 'g', grants) == grants end
if n > grants and redis.call('HINCRBY', KEYS[2], p .. 'b', n - grants) == n - grants then fresh = true end
if fresh then keep_stats(KEYS[2], now_s, true) end -- pruned above
return {grants > 0 and 1 or 0, tonumber(st[5]), tonumber(st[6]), st[7], calls, granted, grants}
