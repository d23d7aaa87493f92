-- KEYS: the workers set, the models hash. ARGV: the registration, ttl_ms, its model, its queue.
-- Renews one worker's registration to ttl_ms from now (Redis's clock), drops registrations
-- that lapsed, and remembers the model's queue for good. Returns Redis's time (ms).
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
return now
