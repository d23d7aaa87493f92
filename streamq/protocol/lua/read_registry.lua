-- KEYS[1] workers_key: the workers set (registration -> when it lapses)
-- KEYS[2] models_key: the models hash (model -> its queue)
-- KEYS[3] models_seen_key: the models' last-seen set
-- KEYS[4] queue_models_key: the queues' models hash (queue -> its base model)
-- Returns Redis's time (ms), the live registrations (by Redis's clock), every model
-- ever registered (flat: name, queue, ...), when a worker last served each (flat: name, ms,
-- ...), and each queue's base model (flat: queue, model, ...).
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
return {
  now,
  redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf'),
  redis.call('HGETALL', KEYS[2]),
  redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES'),
  redis.call('HGETALL', KEYS[4]),
}
