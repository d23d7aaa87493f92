-- KEYS: the job key, the queue, the replay log. ARGV: the job payload, its expiry (ms), the
-- request id, the wake-up channel, the queue name, the queue limit (-1: none), the result key
-- (only read, so not among KEYS: Redis checks declared keys as written too), and optionally
-- the request's callback hash, its callback (JSON) and the hash's expiry (ms).
-- arq's enqueue and the wake-up in one round trip: refuses an id that is queued, running or
-- has a result, or whose replay log still exists (a second job would splice its events into
-- the first's); refuses when the queue holds the limit or more; stores the job and queues it
-- scored with Redis's clock, so a producer's skewed clock cannot defer it.
-- Returns 1 (queued), 0 (id in use) or -1 (queue full).
if redis.call('EXISTS', KEYS[1], ARGV[7], KEYS[3]) > 0 then
  return 0
end
local limit = tonumber(ARGV[6])
if limit >= 0 and redis.call('ZCARD', KEYS[2]) >= limit then
  return -1
end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], now, ARGV[3])
if ARGV[9] then
  redis.call('HSET', ARGV[8], 'spec', ARGV[9])
  redis.call('PEXPIRE', ARGV[8], ARGV[10])
end
redis.call('PUBLISH', ARGV[4], ARGV[5])
return 1
