-- KEYS[1] job_key: the job's key (arq:job:<id>)
-- KEYS[2] queue: arq's queue
-- KEYS[3] log_key: the request's replay log (where the log lives on a Redis Cluster: the
--   id's reservation instead, see ARGV[14])
-- KEYS[4] cancelled_key = nil: the request's cancel record (streamq:cancelled:<id>), deleted
--   as the job is queued: one an earlier job of this id left (see cancel)
-- ARGV[1] payload: the job (arq's envelope)
-- ARGV[2] expiry_ms: the job's expiry
-- ARGV[3] request_id: the request's id (its job's)
-- ARGV[4] wakeup_channel: where the workers are woken
-- ARGV[5] queue_name: what is published there (the queue's name)
-- ARGV[6] limit: the most jobs the queue may hold (-1: no limit)
-- ARGV[7] result_key: arq's result key (only read, so not among KEYS: Redis checks declared
--   keys as written too)
-- ARGV[8] priority = 0: the priority band (the lowest runs first)
-- ARGV[9] tenant = 'default': its tenant (fair share within the band)
-- ARGV[10] delay_ms = 0: how long after now it is due
-- ARGV[11] callback_key = '': the request's callback hash
-- ARGV[12] callback = '': its callback (JSON; '' for none)
-- ARGV[13] callback_ttl_ms = 0: the callback hash's expiry
-- ARGV[14] reservation_ttl_ms = '': the reservation's expiry ('' for none): with it, KEYS[3]
--   is the id's reservation, set as the job is queued (the caller checked the log on the
--   cluster first)
-- ARGV[15] affinity_keys = '': the request's affinity keys, comma-joined, longest prefix first
-- ARGV[16] window_ms = 0: the affinity window (read with affinity keys or eligible workers)
-- ARGV[17] balance_slack = 0: the balance slack in jobs (read likewise)
-- ARGV[18] balance_fraction = 0: the balance slack as a fraction of the least busy worker's
-- ARGV[19] eligible = '': the workers that may run the job, comma-joined ('' for any: a LoRA
--   adapter that not every live worker of the queue serves)
-- arq's enqueue and the wake-up in one round trip: refuses an id that is queued, running or
-- has a result, or whose replay log still exists (a second job would splice its events into
-- the first's); refuses when the queue holds the limit or more; stores the job and queues it
-- scored with Redis's clock (plus the delay), so a producer's skewed clock cannot defer it.
-- The job is indexed for the claim (<queue>:indexed, and its priority's waiting set and
-- tenant's FIFO, or <queue>:deferred until it is due; see claim_jobs); a job due at once
-- joins <queue>:waiting too (every priority's due jobs not started: what autoscalers read).
-- A job with affinity keys is held instead (<queue>:affine:<worker>:<priority>, due back in
-- the index at now + window: its score in <queue>:deferred; see claim_jobs) for the worker
-- its longest known key names (its affinity worker, <queue>:affinity:<key>) if that worker
-- has a free slot (<queue>:free:<worker> > 0) and runs at most max(slack, fraction x
-- theirs) jobs more than the least busy live worker (<queue>:load); else for the least busy
-- live worker, if it has a free slot (marked 'steered' in the index: a balance pick, not a
-- cache hit). A request under a LoRA adapter ends its keys with the adapter's (written '@'
-- and the digest): if it has no live affinity worker, it is held for the live worker with a
-- free slot that is the affinity worker of the fewest adapters (<queue>:adapters:<worker>,
-- scored by when each lapses), also marked 'steered', and that worker is made its affinity
-- worker for the window (its claim makes that 5 minutes), so the adapter's next requests
-- follow it there before it has claimed. A job with eligible workers is kept off the shared
-- index: it is held for one of them (the picks above, made among them), or else made due at
-- once in <queue>:deferred, where the next claim holds it for the least busy of them;
-- <queue>:eligible:<id> names them for the claim (see claim_jobs).
-- Returns 1 (queued), 0 (id in use) or -1 (queue full).
if redis.call('EXISTS', KEYS[1], ARGV[7], KEYS[3]) > 0 then
  return 0
end
local limit = tonumber(ARGV[6])
if limit >= 0 and redis.call('ZCARD', KEYS[2]) >= limit then
  return -1
end
local q, id = KEYS[2], ARGV[3]
local prio, tenant, delay = ARGV[8] or '0', ARGV[9] or 'default', tonumber(ARGV[10] or '0')
local t = redis.call('TIME')
local at = t[1] * 1000 + math.floor(t[2] / 1000) + delay
-- The job first: a Redis full at its maxmemory (noeviction) refuses a script's first write
-- that takes memory, but lets every write through once the script has written anything
-- (the DEL below would), so this must be the first write for a full Redis to refuse it all.
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if KEYS[4] then
  redis.call('DEL', KEYS[4])
end
redis.call('ZADD', q, at, id)
local keys = ARGV[15] or ''
local indexed = keys == '' and (prio .. ' ' .. tenant) or (prio .. ' ' .. tenant .. ' ' .. keys)
local only = ARGV[19] or ''

-- Whether the worker may run the job (any may, unless the job names who may).
local function eligible(worker)
  return only == '' or string.find(',' .. only .. ',', ',' .. worker .. ',', 1, true) ~= nil
end

-- The least busy live worker (fewest jobs, by its claims and the holds since) if it has a
-- free slot, and its load; a worker whose free slots lapsed (dead) is dropped on sight.
local function least_busy()
  local load = q .. ':load'
  for _ = 1, 4 do
    local low = redis.call('ZRANGE', load, 0, 0, 'WITHSCORES')
    if #low == 0 then return nil, nil end
    local free = redis.call('GET', affinity_free_key(q, low[1]))
    if free then
      return tonumber(free) > 0 and low[1] or nil, tonumber(low[2])
    end
    redis.call('ZREM', load, low[1])
  end
  return nil, nil
end

-- The live worker with a free slot that is the affinity worker of the fewest adapters (then
-- the least busy): the one with the most room for an adapter with no live affinity worker.
local function adapter_home(now)
  local home, fewest = nil, nil
  for _, worker in ipairs(redis.call('ZRANGE', q .. ':load', 0, -1)) do
    if eligible(worker) and tonumber(redis.call('GET', affinity_free_key(q, worker)) or '0') > 0 then
      local adapters = redis.call('ZCOUNT', q .. ':adapters:' .. worker, now, '+inf')
      if not fewest or adapters < fewest then home, fewest = worker, adapters end
    end
  end
  return home
end

-- Who gets first pick: the affinity worker of the request's longest known prefix, if it has a
-- free slot and is not far busier than the least busy worker; else, for an adapter with no
-- live affinity worker, the worker with the most room for it; else the least busy worker with
-- a free slot (steered: balance, not the cache). Returns the worker and whether it was steered.
local function first_pick()
  local least, least_load = least_busy()
  for key in string.gmatch(keys, '[^,]+') do
    local worker = redis.call('GET', affinity_worker_key(q, key))
    if worker then
      if eligible(worker) and tonumber(redis.call('GET', affinity_free_key(q, worker)) or '0') > 0 then
        local mine = tonumber(redis.call('ZSCORE', q .. ':load', worker) or '0')
        local slack = math.max(tonumber(ARGV[17]), (least_load or 0) * tonumber(ARGV[18] or '0'))
        if not least_load or mine - least_load <= slack then return worker, false end
      end
      break
    end
  end
  local adapter = string.match(keys, '(@[^,]+)$')
  if adapter then
    local worker = redis.call('GET', affinity_worker_key(q, adapter))
    if not (worker and eligible(worker) and redis.call('EXISTS', affinity_free_key(q, worker)) == 1) then
      local now, window = t[1] * 1000 + math.floor(t[2] / 1000), tonumber(ARGV[16])
      local home = adapter_home(now)
      if home then
        local adapters = q .. ':adapters:' .. home
        if worker then redis.call('ZREM', q .. ':adapters:' .. worker, adapter) end -- gone
        redis.call('SET', affinity_worker_key(q, adapter), home, 'PX', window)
        redis.call('ZADD', adapters, now + window, adapter)
        if redis.call('PTTL', adapters) < 0 then redis.call('PEXPIRE', adapters, window) end
        return home, true
      end
    end
  end
  if only ~= '' then return nil, true end -- the claim holds it for one of them (below)
  return least, true
end

if only ~= '' then
  redis.call('SET', q .. ':eligible:' .. id, only, 'PX', ARGV[2])
end
if delay > 0 then
  redis.call('HSET', q .. ':indexed', id, indexed)
  redis.call('ZADD', q .. ':deferred', at, id)
else
  -- The fraction orders the jobs queued in one ms (a Redis sorted set orders ties by name).
  local score = at + (redis.call('INCR', q .. ':seq') % 1000) / 1000
  redis.call('ZADD', waiting_key(q, prio), score, id)
  redis.call('ZADD', queue_waiting_key(q), score, id) -- every priority's: the autoscaling signal
  local worker, steered = nil, false
  if keys ~= '' or only ~= '' then worker, steered = first_pick() end
  if worker then
    redis.call('HSET', q .. ':indexed', id, steered and (indexed .. ' steered') or indexed)
    redis.call('DECR', affinity_free_key(q, worker))
    redis.call('ZINCRBY', q .. ':load', 1, worker)
    redis.call('ZADD', q .. ':affine:' .. worker .. ':' .. prio, score, id)
    redis.call('ZADD', q .. ':affine-bands:' .. worker, prio, prio)
    redis.call('ZADD', q .. ':deferred', at + tonumber(ARGV[16]), id) -- its window's end
    redis.call('HSET', q .. ':held', id, worker)
  elseif only ~= '' then -- due at once: the next claim holds it for one of its workers
    redis.call('HSET', q .. ':indexed', id, indexed)
    redis.call('ZADD', q .. ':deferred', at, id)
  else
    redis.call('HSET', q .. ':indexed', id, indexed)
    redis.call('ZADD', q .. ':fifo:' .. prio .. ':' .. tenant, score, id)
    redis.call('ZADD', q .. ':tenants:' .. prio, 'NX', 0, tenant)
    redis.call('ZADD', q .. ':bands', prio, prio)
  end
end
if ARGV[12] and ARGV[12] ~= '' then
  redis.call('HSET', ARGV[11], 'spec', ARGV[12])
  redis.call('PEXPIRE', ARGV[11], ARGV[13])
end
if ARGV[14] and ARGV[14] ~= '' then
  redis.call('SET', KEYS[3], '1', 'PX', ARGV[14])
end
redis.call('PUBLISH', ARGV[4], ARGV[5])
return 1
