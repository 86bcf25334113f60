-- publish: the controller writes a dependency's state and parameters.
-- KEYS[1] state  KEYS[2] probes
-- ARGV[1] epoch, then field/value pairs.
-- A new epoch clears the probe counters. An epoch lower than the one stored is
-- refused, so a deposed leader cannot overwrite a newer decision.
-- Returns {1, now ms} when written, {0, stored epoch} when refused.
local stored = tonumber(redis.call('HGET', KEYS[1], 'epoch'))
local epoch = tonumber(ARGV[1])
if stored and epoch < stored then return {0, stored} end
if stored ~= epoch then redis.call('DEL', KEYS[2]) end
local now_ms = math.floor(now_us() / 1000)
local args = {'version', '2', 'epoch', ARGV[1], 'updated_at_ms', int(now_ms)}
for i = 2, #ARGV do args[#args + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(args))
return {1, now_ms}
