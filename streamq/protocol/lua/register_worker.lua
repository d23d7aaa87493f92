-- KEYS[1] workers_key: the workers set
-- KEYS[2] models_key: the models hash
-- KEYS[3] models_seen_key: the models' last-seen set
-- KEYS[4] queue_models_key: the queues' models hash
-- ARGV[1] registration: the worker's registration (JSON)
-- ARGV[2] ttl_ms: how long it lives unless renewed
-- ARGV[3] queue: its queue
-- ARGV[4..] models: the models it serves: its base model, then its adapters
-- Renews one worker's registration to ttl_ms from now (Redis's clock), drops registrations
-- that lapsed, remembers each model's queue for good and when a worker last served it (so
-- that a model whose workers all stopped keeps its requests waiting for the next one), and
-- the queue's base model. Returns {Redis's time (ms), restored}: restored is 1 when the
-- registration, or its models' queue, was not there to renew (a first registration; else
-- it lapsed while the worker could not renew it, or Redis evicted it), else 0.
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local restored = redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
for i = 4, #ARGV do
  restored = restored + redis.call('HSET', KEYS[2], ARGV[i], ARGV[3])
  redis.call('ZADD', KEYS[3], now, ARGV[i])
end
redis.call('HSET', KEYS[4], ARGV[3], ARGV[4])
return {now, math.min(restored, 1)}
