-- register: a worker process says which client it runs, so that the manager
-- and `spillway status` can tell which protocol versions a dependency's
-- fleet speaks (docs/protocol.md §4 register). Every process calls it when
-- it starts using the dependency and then every 15 s.
-- KEYS[1] clients
-- ARGV[1] client ('go', 'python', 'node', ...: no space)  ARGV[2] process id
-- (one per process, no space)
-- The member is '<client> 6 <process id>', 6 being the protocol version of
-- this script (a client cannot claim another), scored by Redis time in ms.
-- Members older than 5 minutes are removed, and the key expires 10 minutes
-- after the last registration. Returns the Redis time in ms.
local now_ms = math.floor(now_us() / 1000)
redis.call('ZADD', KEYS[1], now_ms, ARGV[1] .. ' 6 ' .. ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. int(now_ms - 300000))
redis.call('PEXPIRE', KEYS[1], 600000)
return now_ms
