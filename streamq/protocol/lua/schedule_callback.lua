-- KEYS[1] callbacks_key: the callbacks set
-- KEYS[2] callback_key: the request's callback hash
-- KEYS[3] owner_key = nil: its owner key (nil where it is on another server, a Redis
--   Cluster's data plane: then ARGV[4])
-- ARGV[1] request_id: the request's id
-- ARGV[2] callback = '': its callback as JSON ('' to use the one stored at enqueue)
-- ARGV[3] ttl_ms: how long the hash is kept
-- ARGV[4] owner = nil: where KEYS has no owner key, its value, read just before
-- Makes the request's callback due now (Redis's clock), once, and only once the request
-- has ended (its owner key says `ended`): an attempt that believes it finished but was
-- superseded cannot send a summary of a request still running. A request already scheduled
-- (by another end path, or an earlier attempt of its job) is left alone, as is one with no
-- callback. Returns 1 when scheduled, else 0.
local owner = KEYS[3] and redis.call('GET', KEYS[3]) or ARGV[4]
if redis.call('HEXISTS', KEYS[2], 'state') == 1 or owner ~= 'ended' then
  return 0
end
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[2], 'spec', ARGV[2])
elseif redis.call('HEXISTS', KEYS[2], 'spec') == 0 then
  return 0
end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('HSET', KEYS[2], 'state', 'pending', 'attempts', 0, 'ended_ms', now)
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('ZADD', KEYS[1], now, ARGV[1])
return 1
