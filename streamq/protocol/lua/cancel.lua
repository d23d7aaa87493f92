-- KEYS: the job key, then queues to look at first. ARGV: the request id, the cancel channel,
-- the in-progress key, the models hash (these two only read, so not among KEYS: Redis checks
-- declared keys as written too). Atomically: a running job is told to stop (every worker
-- hears the channel; the one running it cancels it); a queued one is taken off its queue
-- before any worker can. The queue is looked for among KEYS[2...] (the caller's guesses),
-- then on every queue a model was ever registered on, so a caller need not know which.
-- Returns 'running', 'queued' or 'unknown'.
if redis.call('EXISTS', ARGV[3]) == 1 then
  redis.call('PUBLISH', ARGV[2], ARGV[1])
  return 'running'
end
local queues = {unpack(KEYS, 2)}
for _, queue in ipairs(redis.call('HVALS', ARGV[4])) do
  queues[#queues + 1] = queue
end
for _, queue in ipairs(queues) do
  if redis.call('ZREM', queue, ARGV[1]) == 1 then
    redis.call('DEL', KEYS[1])
    -- An attempt whose lease lapsed (Redis was away) may still be running: stop it too.
    redis.call('PUBLISH', ARGV[2], ARGV[1])
    return 'queued'
  end
end
return 'unknown'
