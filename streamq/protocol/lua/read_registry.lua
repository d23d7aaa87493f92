-- KEYS: the workers set, the models hash. Returns the live registrations (by Redis's
-- clock), and every model ever registered (flat: name, queue, ...).
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
return {redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf'), redis.call('HGETALL', KEYS[2])}
