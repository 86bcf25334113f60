-- hold: a process that holds leases of its own (per-call permits) puts
-- back those Redis lost, within a fraction of learn_ms of Redis losing
-- them (lib.lua learning). Every process holding a lease calls it every
-- 250 ms with every lease it holds whose ttl has not passed by its own
-- clock. It checks the replication id as acquire does, and so finds a
-- failover out even when nothing is acquired.
-- KEYS[1] state  KEYS[2] leases  KEYS[3] released (lib.lua remember_released)
-- ARGV[1] lease ttl ms  ARGV[2..] the members held
-- Returns {ms of learning left (0: none; -1: no state is stored), members
-- put back, the members the fleet no longer counts}. A lease released since
-- is not put back. Outside learning, with a state, a member that is missing
-- or expired by Redis's clock is named in the third element: its holder
-- came back too late to put it back, and another call may hold its slot,
-- so its call stops at once (as after a renewal that found it lost).
-- Outside learning, with a state, it writes nothing: renew extends the
-- leases.
local now_ms = math.floor(now_us() / 1000)
local st = redis.call('HMGET', KEYS[1], 'version', 'replid', 'learn_until_ms', 'replid_at_ms')
local left = -1
if st[1] then left = learning(KEYS[1], st[2], st[3], st[4], now_ms) end
local members = {}
for i = 2, #ARGV do members[#members + 1] = ARGV[i] end
if left == 0 then
  local lost = {}
  if #members > 0 then
    local scores = redis.call('ZMSCORE', KEYS[2], unpack(members))
    for i, m in ipairs(members) do
      if not scores[i] or tonumber(scores[i]) <= now_ms then lost[#lost + 1] = m end
    end
  end
  return {0, 0, lost}
end
return {left, relearn(KEYS[2], members, now_ms + tonumber(ARGV[1]), KEYS[3], now_ms), {}}
