-- KEYS: per job, its in-progress key and its request's owner key. ARGV: ttl_ms, then per
-- job the holder it should name (<worker id>:<attempt>) and the attempt.
-- The owner key decides, not the lease: while no newer attempt owns the request and it has
-- not ended, the lease is this attempt's, so it is set to the holder (renewed, taken back
-- after it lapsed, or taken from a claim whose attempt has not taken the request over yet).
-- Otherwise it is lost and left alone: that attempt stops without writing the end (a newer
-- one owns the request, or it ended). Returns 1 (held) or 0 (lost) per job.
local ttl, held = ARGV[1], {}
for i = 1, #KEYS, 2 do
  local holder, attempt = ARGV[i + 1], tonumber(ARGV[i + 2])
  local owner = redis.call('GET', KEYS[i + 1])
  if owner == 'ended' or (owner and tonumber(owner) > attempt) then
    held[#held + 1] = 0
  else
    redis.call('SET', KEYS[i], holder, 'PX', ttl)
    held[#held + 1] = 1
  end
end
return held
