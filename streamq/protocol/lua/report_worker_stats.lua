-- KEYS[1] stats_key: the stats hash (worker id -> its report)
-- KEYS[2] seen_key: the stats-seen set (worker id -> when it last reported)
-- ARGV[1] worker_id: the worker's id
-- ARGV[2] stats: its stats (JSON)
-- ARGV[3] keep_ms: how long a report is kept
-- Stores this worker's report, scores it with Redis's time in the seen set, and drops
-- reports older than keep_ms (workers that stopped or vanished long ago). Returns the time.
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], now, ARGV[1])
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[3]))
if #old > 0 then
  redis.call('HDEL', KEYS[1], unpack(old))
  redis.call('ZREM', KEYS[2], unpack(old))
end
return now
