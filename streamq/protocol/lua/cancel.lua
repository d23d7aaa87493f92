-- KEYS[1] job_key: the job's key
-- KEYS[2] cancelled_key: the request's cancel record (streamq:cancelled:<id>)
-- KEYS[3..] queues = {}: queues to look in first (the caller's guesses)
-- ARGV[1] request_id: the request's id (its job's)
-- ARGV[2] cancel_channel: where a running job is told to stop
-- ARGV[3] in_progress_key: the job's in-progress key (only read, so not among KEYS: Redis
--   checks declared keys as written too)
-- ARGV[4] models_key: the models hash (only read, likewise)
-- ARGV[5] queued_only = '': '1' to take the job off only if it is queued (a request whose
--   wait for a worker passed its bound)
-- ARGV[6] cancelled_ttl_ms = 86400000: how long the cancel record is kept (the job's expiry)
-- Atomically: a running job is told to stop (every worker hears the channel; the one
-- running it cancels it), unless only a queued one is to go; the cancel is recorded first
-- (KEYS[2]: Redis's time in ms) for a worker that misses the message (its listener was
-- reconnecting) or takes the request over later: the lease renewal and the claim report it
-- (see renew_leases, claim_jobs), and finish_job deletes it with the job. A queued one is
-- taken off its queue, out of the claim's index (see claim_jobs) and out of <queue>:waiting,
-- before any worker can. The queue is looked for among the caller's guesses, then on every
-- queue a model was ever registered on, so a caller need not know which.
-- Returns 'running', 'queued' or 'unknown'.
if redis.call('EXISTS', ARGV[3]) == 1 then
  if ARGV[5] ~= '1' then
    local t = redis.call('TIME')
    redis.call('SET', KEYS[2], t[1] * 1000 + math.floor(t[2] / 1000), 'PX', ARGV[6])
    redis.call('PUBLISH', ARGV[2], ARGV[1])
  end
  return 'running'
end
local queues = {unpack(KEYS, 3)}
for _, queue in ipairs(redis.call('HVALS', ARGV[4])) do
  queues[#queues + 1] = queue
end
local id = ARGV[1]
for _, queue in ipairs(queues) do
  if redis.call('ZREM', queue, id) == 1 then
    redis.call('DEL', KEYS[1])
    local meta = redis.call('HGET', queue .. ':indexed', id)
    if meta then
      -- An emptied tenant or band is dropped by the next claim that meets it.
      local prio, tenant = string.match(meta, '^(%S+) (%S+)')
      redis.call('HDEL', queue .. ':indexed', id)
      redis.call('ZREM', waiting_key(queue, prio), id)
      redis.call('ZREM', queue .. ':fifo:' .. prio .. ':' .. tenant, id)
      redis.call('ZREM', queue .. ':deferred', id)
      local held_for = redis.call('HGET', queue .. ':held', id) -- held for the worker of its prefix
      if held_for then
        redis.call('HDEL', queue .. ':held', id)
        redis.call('ZREM', queue .. ':affine:' .. held_for .. ':' .. prio, id)
      end
    end
    redis.call('ZREM', running_key(queue), id)
    redis.call('ZREM', queue_waiting_key(queue), id)
    -- An attempt whose lease lapsed (Redis was away) may still be running: stop it too.
    redis.call('PUBLISH', ARGV[2], id)
    return 'queued'
  end
end
return 'unknown'
