-- KEYS[1..] jobs{in_progress_key, job_key, owner_key = nil}: per job, its in-progress key, its
--   key (arq:job:<id>) and its request's owner key (nil for every job where the owner keys
--   live on another server, a Redis Cluster's data plane: then each job's owner is in ARGV)
-- ARGV[1] ttl_ms: how long a renewed lease lives
-- ARGV[2..] jobs{holder, attempt, cancelled_key, owner = nil}: per job, the holder its lease
--   should name (<worker id>:<attempt>), the attempt, its request's cancel record
--   (streamq:cancelled:<id>; only read, so not among KEYS), and, where KEYS has no owner keys,
--   the owner key's value, read just before ('' for none; ownership only moves forward, so an
--   early read acts as an earlier call)
-- The owner key decides, not the lease: while no newer attempt owns the request and it has
-- not ended, the lease is this attempt's, so it is set to the holder (renewed, taken back
-- after it lapsed, or taken from a claim whose attempt has not taken the request over yet).
-- Otherwise it is lost and left alone: that attempt stops without writing the end (a newer
-- one owns the request, or it ended). A lease is only set while its job is stored: an owner
-- read ahead may predate the end, and the job's end deletes both its key and its lease here,
-- so a renewal that runs after it must not set the lease again (nor where an evicting Redis
-- deleted the job: nobody could take it over); the attempt goes on. A held job whose
-- request has a cancel recorded (see cancel) is reported so, and its worker cancels it as if
-- it had heard the cancel's message, which it may have missed (its listener was
-- reconnecting).
-- Returns per job 1 (held), 2 (held, and its request cancelled) or 0 (lost).
local ttl, held = ARGV[1], {}
local ahead = #ARGV - 1 == 2 * #KEYS
local step = ahead and 2 or 3
local width = ahead and 4 or 3
for i = 1, #KEYS, step do
  local at = (i - 1) / step * width + 2
  local holder, attempt, cancelled = ARGV[at], tonumber(ARGV[at + 1]), ARGV[at + 2]
  local owner
  if ahead then
    owner = ARGV[at + 3]
    if owner == '' then owner = false end
  else
    owner = redis.call('GET', KEYS[i + 2])
  end
  if owner == 'ended' or (owner and tonumber(owner) > attempt) then
    held[#held + 1] = 0
  else
    if redis.call('EXISTS', KEYS[i + 1]) == 1 then
      redis.call('SET', KEYS[i], holder, 'PX', ttl)
    end
    held[#held + 1] = 1 + redis.call('EXISTS', cancelled)
  end
end
return held
