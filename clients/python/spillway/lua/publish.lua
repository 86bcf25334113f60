-- publish: the controller writes a dependency's state and parameters.
-- KEYS[1] state  KEYS[2] probes
-- ARGV[1] epoch  ARGV[2] sequence (0 = the stored one plus one), then
-- field/value pairs.
-- A new epoch clears the probe counters. An epoch lower than the one stored is
-- refused, so a controller cannot undo a newer transition; a sequence not
-- greater than the one stored is refused, so a deposed leader cannot overwrite
-- a newer publication at the same epoch.
-- A write that changes the epoch, the state or the limit is announced on the
-- changes channel (lib.lua announce_change).
-- The pair 'restored' '1' says the manager published a state before that
-- Redis no longer holds: Redis lost its data, and when no state is stored
-- the dependency learns for learn_ms (lib.lua learning) before anything
-- new is admitted.
-- Returns {1, now ms} when written, {0, stored epoch} or {2, stored sequence}
-- when refused.
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'seq', 'state', 'limit')
local stored = tonumber(cur[1])
local epoch = tonumber(ARGV[1])
if stored and epoch < stored then return {0, stored} end
local stored_seq = tonumber(cur[2]) or 0
local seq = tonumber(ARGV[2])
if seq == 0 then
  seq = stored_seq + 1
elseif seq <= stored_seq then
  return {2, stored_seq}
end
-- A plan that did not see the workers' last trip would undo it (lib.lua
-- unacknowledged_trip): it is refused too, with {3, tripped_at_ms}. Its
-- pairs include trip_acked_ms and trip_acked_count.
local tripped = unacknowledged_trip(KEYS[1], ARGV)
if tripped then return {3, tripped} end
if stored ~= epoch then redis.call('DEL', KEYS[2]) end
local now_ms = math.floor(now_us() / 1000)
-- 'version' 5: workers of version 5 act on this state as well as those of
-- version 6 (lib.lua version_refusal); 'manager_version' says the manager
-- speaks 6, for as long as 'manager_seq' is this publication's seq.
local args = {'version', '5', 'manager_version', '6', 'manager_seq', int(seq),
  'epoch', ARGV[1], 'seq', int(seq), 'updated_at_ms', int(now_ms)}
for i = 3, #ARGV do args[#args + 1] = ARGV[i] end
local state, limit, restored = cur[3], cur[4], false
for i = 3, #ARGV - 1, 2 do
  if ARGV[i] == 'state' then state = ARGV[i + 1] elseif ARGV[i] == 'limit' then limit = ARGV[i + 1]
  elseif ARGV[i] == 'restored' then restored = ARGV[i + 1] == '1' end
end
if restored and not stored then
  args[#args + 1] = 'learn_until_ms'
  args[#args + 1] = int(now_ms + learn_ms)
end
redis.call('HSET', KEYS[1], unpack(args))
if stored ~= epoch or state ~= cur[3] or limit ~= cur[4] then
  announce_change(KEYS[1], ARGV[1], state or '', limit or '')
end
return {1, now_ms}
