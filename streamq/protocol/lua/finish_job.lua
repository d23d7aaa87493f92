-- KEYS[1] in_progress_key: the job's in-progress key (its lease)
-- KEYS[2] job_key: the job's key
-- KEYS[3] retry_key: arq's count of the job's tries
-- KEYS[4] result_key: arq's result key
-- KEYS[5] queue: the job's queue
-- KEYS[6] abort_key: arq's abort set
-- KEYS[7] running_key: <queue>:running
-- KEYS[8] owner_key = nil: the request's owner key (nil where it is on another server, a Redis
--   Cluster's data plane: then ARGV[10])
-- ARGV[1] job_id: the job's id
-- ARGV[2] worker_id: this worker's id
-- ARGV[3] holder: the attempt's lease holder (<worker id>:<attempt>)
-- ARGV[4] attempt: the attempt (0: unknown)
-- ARGV[5] action: what to do: finish, failed, retry or release (below)
-- ARGV[6] result = '': the result (JSON; '' for none)
-- ARGV[7] result_ttl_ms: the result's expiry (0: kept forever)
-- ARGV[8] score_increment = '': the score to add on a retry ('' for none)
-- ARGV[9] cancelled_key: the request's cancel record (streamq:cancelled:<id>; only deleted, so
--   not among KEYS: a worker may read and delete it, not write it), deleted with the job
-- ARGV[10] owner = nil: where KEYS has no owner key, its value, read just before ('' for none)
-- arq's bookkeeping at the end of an attempt (arq's `finish_job` and `finish_failed_job`),
-- done only by an attempt no newer attempt has superseded: a superseded attempt never
-- removes the job, never writes its result and never hands it back. Every attempt releases
-- its own lease (the key naming this worker or this attempt); a lease naming another
-- holder is left to it. What to do:
-- - `finish`: the job is done (its request ended): result stored, job off its queue, its
--   cancel record (a cancel sent while it ran, see cancel) deleted;
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
elseif ARGV[10] ~= '' then
  owner = ARGV[10]
end
if action == 'release' or (attempt > 0 and owner and owner ~= 'ended' and tonumber(owner) > attempt) then
  return 0
end
if action == 'retry' then
  if incr ~= '' then
    redis.call('ZINCRBY', queue, incr, id)
  else
    local t = redis.call('TIME')
    redis.call('ZADD', queue_waiting_key(queue), 'NX', t[1] * 1000 + math.floor(t[2] / 1000), id)
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
if ARGV[9] ~= '' then
  redis.call('DEL', ARGV[9])
end
redis.call('ZREM', abort, id)
redis.call('ZREM', queue, id)
redis.call('ZREM', running, id)
redis.call('ZREM', queue_waiting_key(queue), id)
return 1
