-- KEYS: per job, its in-progress key and its request's owner key. ARGV: ttl_ms, then per
-- job the holder it should name (<worker id>:<attempt>) and the attempt. Where the owner
-- keys live on another server (a Redis Cluster's data plane), KEYS holds the in-progress
-- keys only and each job's ARGV has a third item: the owner key's value, read just before
-- ('' for none; ownership only moves forward, so an early read acts as an earlier call).
-- The owner key decides, not the lease: while no newer attempt owns the request and it has
-- not ended, the lease is this attempt's, so it is set to the holder (renewed, taken back
-- after it lapsed, or taken from a claim whose attempt has not taken the request over yet).
-- Otherwise it is lost and left alone: that attempt stops without writing the end (a newer
-- one owns the request, or it ended). Returns 1 (held) or 0 (lost) per job.
local ttl, held = ARGV[1], {}
local ahead = #ARGV - 1 == 3 * #KEYS
local step = ahead and 1 or 2
for i = 1, #KEYS, step do
  local job = (i - 1) / step
  local holder, attempt, owner
  if ahead then
    holder, attempt, owner = ARGV[3 * job + 2], tonumber(ARGV[3 * job + 3]), ARGV[3 * job + 4]
    if owner == '' then owner = false end
  else
    holder, attempt = ARGV[2 * job + 2], tonumber(ARGV[2 * job + 3])
    owner = redis.call('GET', KEYS[i + 1])
  end
  if owner == 'ended' or (owner and tonumber(owner) > attempt) then
    held[#held + 1] = 0
  else
    redis.call('SET', KEYS[i], holder, 'PX', ttl)
    held[#held + 1] = 1
  end
end
return held
