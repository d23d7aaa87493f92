-- KEYS: the workers set, the models hash, the models' last-seen set, the queues' models
-- hash. Returns Redis's time (ms), the live registrations (by Redis's clock), every model
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
