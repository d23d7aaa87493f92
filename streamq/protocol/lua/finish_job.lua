-- KEYS: the job's in-progress key, job key, retry key, result key, its queue, arq's abort
-- set, <queue>:running, and the request's owner key. ARGV: the job id, this worker's id,
-- the attempt's lease holder (<worker id>:<attempt>), the attempt (0: unknown), what to do,
-- the result (JSON, '' for none), its expiry in ms (0: kept forever), the score to add on
-- a retry ('' for none); where the owner key is on another server (a Redis Cluster's data
-- plane), KEYS has no owner key and ARGV[9] is its value, read just before ('' for none).
-- arq's bookkeeping at the end of an attempt (arq's `finish_job` and `finish_failed_job`),
-- done only by an attempt no newer attempt has superseded: a superseded attempt never
-- removes the job, never writes its result and never hands it back. Every attempt releases
-- its own lease (the key naming this worker or this attempt); a lease naming another
-- holder is left to it. What to do:
-- - `finish`: the job is done (its request ended): result stored, job off its queue;
-- - `failed`: arq gave up on it without running it: the same, but a result already stored
--   (the request had ended, by the attempt that wrote it) is kept;
-- - `retry`: handed back: the job stays queued (its score raised by a deferral) and the
--   next claim looks at it first; one due at once waits again (<queue>:waiting);
-- - `release`: the attempt knows it was superseded: its lease only.
-- Returns 1 when the bookkeeping was done, 0 when it was left to the attempt that owns it.
local in_progress, job, retry, result, queue, abort, running, owner_key = unpack(KEYS)
local id, me, holder, attempt, action = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local data, expiry, incr = ARGV[6], tonumber(ARGV[7]), ARGV[8]
local lease = redis.call('GET', in_progress)
if lease == me or lease == holder or lease == '1' then
  redis.call('DEL', in_progress)
end
local owner
if owner_key then
  owner = redis.call('GET', owner_key)
elseif ARGV[9] ~= '' then
  owner = ARGV[9]
end
if action == 'release' or (attempt > 0 and owner and owner ~= 'ended' and tonumber(owner) > attempt) then
  return 0
end
if action == 'retry' then
  if incr ~= '' then
    redis.call('ZINCRBY', queue, incr, id)
  else
    local t = redis.call('TIME')
    redis.call('ZADD', queue .. ':waiting', 'NX', t[1] * 1000 + math.floor(t[2] / 1000), id)
  end
  redis.call('ZADD', running, 0, id)
  return 1
end
if data ~= '' then
  local set = {'SET', result, data}
  if expiry > 0 then
    set[#set + 1], set[#set + 2] = 'PX', expiry
  end
  if action == 'failed' then
    set[#set + 1] = 'NX'
  end
  redis.call(unpack(set))
end
redis.call('DEL', retry, job)
redis.call('ZREM', abort, id)
redis.call('ZREM', queue, id)
redis.call('ZREM', running, id)
redis.call('ZREM', queue .. ':waiting', id)
return 1
