-- versions: which protocol versions a dependency's fleet speaks; read only.
-- KEYS[1] clients  KEYS[2] calls  KEYS[3] stats
-- Returns {now ms, {member, ...} of the processes registered in the last
-- 60 s (register.lua: '<client> <version> <process id>'), from second,
-- calls, {version, calls, ...}}: calls is s + f + t over the 60 seconds
-- [from, from + 60) (stats), the six whole 10 s buckets before the current
-- one, and each version's count over the same buckets (the calls hash,
-- lib.lua count_version). Calls that no version counted were made by
-- workers older than version 5.
local now_ms = math.floor(now_us() / 1000)
local now_s = math.floor(now_ms / 1000)
local from = now_s - now_s % 10 - 60
local seen = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. int(now_ms - 60000), '+inf')
local fields = {}
for s = from, from + 59 do
  local p = int(s) .. ':'
  fields[#fields + 1] = p .. 's'
  fields[#fields + 1] = p .. 'f'
  fields[#fields + 1] = p .. 't'
end
local calls = 0
for _, v in ipairs(redis.call('HMGET', KEYS[3], unpack(fields))) do
  if v then calls = calls + tonumber(v) end
end
local by, order = {}, {}
local kv = redis.call('HGETALL', KEYS[2])
for i = 1, #kv, 2 do
  local b, v = string.match(kv[i], '^(%d+):(%d+)$')
  b = tonumber(b)
  if b and b >= from and b < from + 60 then
    if not by[v] then
      by[v] = 0
      order[#order + 1] = v
    end
    by[v] = by[v] + tonumber(kv[i + 1])
  end
end
local versions = {}
for _, v in ipairs(order) do
  versions[#versions + 1] = v
  versions[#versions + 1] = by[v]
end
return {now_ms, seen, from, calls, versions}
