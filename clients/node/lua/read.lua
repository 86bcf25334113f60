-- read: the controller reads the state hash and Redis's time in one call, so
-- that it plans by the time of the node that holds the dependency.
-- KEYS[1] state
-- Returns {now ms, {field, value, ...}} (the fields empty when there is no state).
return {math.floor(now_us() / 1000), redis.call('HGETALL', KEYS[1])}
