-- KEYS[1] log_key: the request's log
-- KEYS[2] owner_key: its owner key
-- ARGV[1] attempt: the attempt to own it
-- ARGV[2] ttl_ms: the owner key's expiry
-- Makes that attempt the owner (fencing off older ones) unless the request already ended or
-- a newer attempt owns it.
-- Returns {1 if the attempt owns the request now else 0, the log as it is at that moment}.
local owner = redis.call('GET', KEYS[2]) or '0'
local attempt = tonumber(ARGV[1])
local owns = 0
if owner ~= 'ended' and attempt >= tonumber(owner) then
  if attempt > tonumber(owner) then
    redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
  end
  owns = 1
end
return {owns, redis.call('XRANGE', KEYS[1], '-', '+')}
