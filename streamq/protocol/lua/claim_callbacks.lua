-- KEYS[1] callbacks_key: the callbacks set (request id -> when its delivery is due)
-- ARGV[1] count: how many deliveries to claim at most
-- ARGV[2] lease_ms: the claim's lease
-- ARGV[3] callback_prefix: the callback hashes' prefix (a hash is it and the request id)
-- Claims due deliveries by pushing their due time a lease ahead (a worker that dies leaves
-- them due again then), on Redis's clock. Returns Redis's time (ms), then per delivery:
-- request id, callback JSON, attempts so far, ended_ms. A delivery whose hash is gone
-- (expired) is dropped.
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local claimed = {now}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))) do
  local hash = redis.call('HMGET', ARGV[3] .. id, 'spec', 'attempts', 'ended_ms', 'state')
  if not hash[1] or hash[4] ~= 'pending' then
    redis.call('ZREM', KEYS[1], id)
  else
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), id)
    claimed[#claimed + 1] = id
    claimed[#claimed + 1] = hash[1]
    claimed[#claimed + 1] = hash[2] or '0'
    claimed[#claimed + 1] = hash[3] or tostring(now)
  end
end
return claimed
