-- KEYS[1] callbacks_key: the callbacks set
-- KEYS[2] callback_key: the request's callback hash
-- ARGV[1] request_id: the request's id
-- ARGV[2] outcome: delivered, retry or failed
-- ARGV[3] attempts: attempts made
-- ARGV[4] http_status = '': the answer's HTTP status ('' if none)
-- ARGV[5] error = '': the error ('' if none)
-- ARGV[6] retry_in_ms: ms until the next try (retry)
-- ARGV[7] ttl_ms: how long the hash is kept
-- Records one delivery attempt; `retry` makes it due again later, the others end it.
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('HSET', KEYS[2], 'attempts', ARGV[3])
if ARGV[4] ~= '' then
  redis.call('HSET', KEYS[2], 'http_status', ARGV[4])
end
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[2], 'last_error', ARGV[5])
end
if ARGV[2] == 'retry' then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[6]), ARGV[1])
else
  redis.call('HSET', KEYS[2], 'state', ARGV[2])
  if ARGV[2] == 'delivered' then
    redis.call('HSET', KEYS[2], 'delivered_ms', now)
  end
  redis.call('ZREM', KEYS[1], ARGV[1])
end
redis.call('PEXPIRE', KEYS[2], ARGV[7])
return 1
