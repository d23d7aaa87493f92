-- KEYS: the log, the owner key. ARGV: attempt, ttl_ms. Makes that attempt the owner
-- (fencing off older ones) unless the request already ended, and returns the log as it
-- is at that moment.
local owner = redis.call('GET', KEYS[2]) or '0'
if owner ~= 'ended' and tonumber(ARGV[1]) > tonumber(owner) then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
end
return redis.call('XRANGE', KEYS[1], '-', '+')
