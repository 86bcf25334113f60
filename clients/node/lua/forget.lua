-- forget: make a lease stop counting whose acquisition's reply was never read.
-- KEYS[1] leases  ARGV[1] member
-- The member is written with score 0, long expired, whether the acquisition
-- ran (its lease ends now) or is still queued behind this script (acquire
-- adds members with ZADD NX, so it cannot revive it). The member is swept
-- with the other expired leases. Returns 1.
redis.call('ZADD', KEYS[1], 0, ARGV[1])
return 1
