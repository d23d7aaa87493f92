-- KEYS[1] queue: arq's queue
-- ARGV[1] wanted: how many jobs to claim (0: only the bookkeeping below)
-- ARGV[2] lease_ms: the claimed jobs' lease (their in-progress keys' TTL)
-- ARGV[3] page: queue entries to read per page
-- ARGV[4] in_progress_prefix: the in-progress keys' prefix
-- ARGV[5] worker_id: this worker's id (the leases' holder)
-- ARGV[6] weights_key = 'streamq:tenant-weights': the tenant weights hash (only read)
-- ARGV[7] scan_interval_ms = 1000: the minimum ms between two scans of the whole queue
-- ARGV[8] affinity_worker_ttl_ms = 0: for prefix-aware pickup (0: off), how long this worker
--   stays the affinity worker of the prefixes it claims
-- ARGV[9] free_ttl_ms = 0: how long its free-slot count lives (0: none is set)
-- ARGV[10] running = 0: how many jobs it runs now
-- ARGV[11] spare = 0: its free slots beyond those it asks for (one of several front ends of
--   an engine asks for its share)
-- ARGV[12] wakeup_channel = '': where the other workers are told when this claim held a job
--   for one of them or left jobs it moved into the index untaken (a held job's window
--   passed, a deferred job came due), so that no job waits for their next poll ('' for none)
-- ARGV[13] cancelled_prefix = 'streamq:cancelled:': the cancel records' prefix (only read)
-- ARGV[14] job_prefix = 'arq:job:': arq's job keys' prefix (each claimed job's payload is read)
-- ARGV[15] retry_prefix = 'arq:retry:': arq's try counts' prefix (each claimed job's is counted
--   up, as arq's run_job does when it starts a job)
-- ARGV[16] ahead = 0: jobs to claim beyond `wanted`, to wait inside this worker's engine for a
--   slot to free (see 4. below)
-- Returns Redis's time (ms), the affinity hits, misses and expired windows of this claim,
-- then id, score, cancelled, payload, try for each job claimed (score: the job's score in
-- the queue; cancelled: 1 if a cancel was recorded while an earlier attempt ran it, see
-- cancel: the worker ends it `cancelled` at once, with what the earlier attempts logged;
-- payload: arq's job, false when its key is gone; try: arq's try count, this one
-- included), so that a worker starts what it claimed without reading each job again.
-- Jobs are due by Redis's clock, never a worker's.
--
-- arq's queue stays the source of truth (a job is queued or running while it is in it);
-- the claim takes, in this order, until it has enough:
-- 1. claimed jobs whose lease lapsed (their worker died or handed them back) or whose
--    arq Retry is due, from <queue>:running (id -> when to look at it again): a taken-over
--    request has a subscriber waiting mid-stream;
-- 2. the index of waiting jobs, after promoting due ones from <queue>:deferred and the
--    jobs held for a worker whose window passed (also in <queue>:deferred): the lowest
--    priority band first; in a band, the jobs held for this worker (enqueue routed them
--    here, as this worker served their prefix, or steered them here as the least busy: a
--    miss), then the tenant with the lowest pass (stride scheduling: a pick adds
--    1/weight, a held job's too; a tenant starts at the band's virtual time, the pass of
--    the band's last pick, so an idle tenant banks no credit); FIFO in a tenant. A claimed
--    job's longest and shortest prefix keys name this worker their affinity worker for its
--    TTL (<queue>:affinity:<key>); a claim of a job with keys not held for this worker is a
--    miss; the worker's free slots and load are set for enqueue to read;
-- 3. at most once per scan interval (all workers together), arq's queue itself, in score
--    order, for due jobs nobody indexed (a bare ZADD) or claimed through this script, and
--    indexed ones the index no longer reaches (an evicting Redis deleted part of it);
-- 4. with `wanted` taken, up to `ahead` more from the index, for the worker's engine to
--    start as slots free, as far as the waiting jobs exceed the other workers' free slots.
-- A job only some workers may run (<queue>:eligible:<id>: a LoRA adapter not every worker
-- serves, see enqueue) never joins the shared index: when its window passes it is held
-- again for one of them, and a lapsed lease of one is taken over only by one of them.
-- <queue>:waiting holds every job due and not started (the autoscaling signal): enqueue
-- adds those due at once, this claim those it makes due (a deferred job, a lapsed lease left
-- for a later claim), and removes each it takes. Asked for no jobs (how many: 0, free-slot TTL
-- 0), the claim only does that bookkeeping, so the signal stays exact with no worker alive.
local q = KEYS[1]
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local wanted, ttl, page, prefix, me = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], ARGV[5]
local weights, scan_ms = ARGV[6] or 'streamq:tenant-weights', ARGV[7] or '1000'
local affinity_ttl, free_ttl, busy = tonumber(ARGV[8] or '0'), tonumber(ARGV[9] or '0'), tonumber(ARGV[10] or '0')
local spare = tonumber(ARGV[11] or '0')
local wakeup = ARGV[12] or ''
local cancelled = ARGV[13] or 'streamq:cancelled:'
local job_prefix, retry_prefix = ARGV[14] or 'arq:job:', ARGV[15] or 'arq:retry:'
local ahead = tonumber(ARGV[16] or '0')
local running, indexed, bands, vtimes = running_key(q), q .. ':indexed', q .. ':bands', q .. ':vtime'
local held, my_bands = q .. ':held', q .. ':affine-bands:' .. me
local claimed, n = {now, 0, 0, 0}, 0
local held_for_others, promoted = false, false

-- An adapter's key ('@' and a digest) names this worker its affinity worker, and joins this
-- worker's adapters (<queue>:adapters:<worker>, scored by when that lapses), unless the job
-- came here for balance while the adapter's affinity worker lives: the adapter stays where
-- it is loaded.
local function become_adapter_worker(key, steered)
  local worker_key = affinity_worker_key(q, key)
  local before = redis.call('GET', worker_key)
  if before and before ~= me then
    if steered and redis.call('EXISTS', affinity_free_key(q, before)) == 1 then return end
    redis.call('ZREM', q .. ':adapters:' .. before, key)
  end
  redis.call('SET', worker_key, me, 'PX', affinity_ttl)
  local mine = q .. ':adapters:' .. me
  redis.call('ZREMRANGEBYSCORE', mine, '-inf', now)
  redis.call('ZADD', mine, now + affinity_ttl, key)
  redis.call('PEXPIRE', mine, affinity_ttl)
end

-- A claimed job's prefix keys (after priority and tenant in its index entry) name this
-- worker: its longest, which the request's follow-ups share, and its shortest, which
-- requests that open alike share (the keys between cost a SET each for rarer matches); a
-- request under a LoRA adapter ends its keys with the adapter's (its shortest).
local function become_affinity_worker(meta)
  local keys = meta and string.match(meta, '^%S+ %S+ (%S+)')
  if keys and affinity_ttl > 0 then
    local longest, shortest = string.match(keys, '^([^,]+)'), string.match(keys, '([^,]+)$')
    for _, key in ipairs(shortest ~= longest and {longest, shortest} or {longest}) do
      if string.sub(key, 1, 1) == '@' then
        become_adapter_worker(key, string.match(meta, ' steered$') ~= nil)
      else
        redis.call('SET', affinity_worker_key(q, key), me, 'PX', affinity_ttl)
      end
    end
  end
  return keys ~= nil
end

-- Into its band's index at its waiting score (none: it left the queue), noted for the wake-up.
local function reindex(id, band, tenant, score)
  if score then
    redis.call('ZADD', q .. ':fifo:' .. band .. ':' .. tenant, score, id)
    redis.call('ZADD', q .. ':tenants:' .. band, 'NX', 0, tenant)
    redis.call('ZADD', bands, band, band)
    promoted = true
  end
end

-- Whether this worker may run the job: any may, unless <queue>:eligible:<id> names who may.
local function may_run(id)
  local only = redis.call('GET', q .. ':eligible:' .. id)
  return not only or string.find(',' .. only .. ',', ',' .. me .. ',', 1, true) ~= nil
end

-- A job only some workers may run is held again, for the least busy live one of them (one
-- with a free slot first) until its next window's end, or with none live only deferred
-- that long. Returns false for a job any worker may run (the caller indexes it).
local function hold_for_eligible(id, band, score)
  local only = redis.call('GET', q .. ':eligible:' .. id)
  if not only then return false end
  local best, best_free, best_load = nil, false, nil
  for worker in string.gmatch(only, '[^,]+') do
    local free = redis.call('GET', affinity_free_key(q, worker))
    if free then
      local has_free = tonumber(free) > 0
      local load = tonumber(redis.call('ZSCORE', q .. ':load', worker) or '0')
      if not best or (has_free and not best_free) or (has_free == best_free and load < best_load) then
        best, best_free, best_load = worker, has_free, load
      end
    end
  end
  if best then
    redis.call('ZADD', q .. ':affine:' .. best .. ':' .. band, score, id)
    redis.call('ZADD', q .. ':affine-bands:' .. best, band, band)
    redis.call('HSET', held, id, best)
    held_for_others = held_for_others or best ~= me
  end
  redis.call('ZADD', q .. ':deferred', now + (free_ttl > 0 and free_ttl or 3000), id)
  return true
end

local function take(id, score)
  if redis.call('SET', prefix .. id, me, 'NX', 'PX', ttl) then
    redis.call('ZADD', running, now + ttl, id)
    claimed[#claimed + 1] = id
    claimed[#claimed + 1] = score
    claimed[#claimed + 1] = redis.call('EXISTS', cancelled .. id)
    claimed[#claimed + 1] = redis.call('GET', job_prefix .. id)
    claimed[#claimed + 1] = redis.call('INCR', retry_prefix .. id)
    redis.call('EXPIRE', retry_prefix .. id, 88400) -- as arq's run_job
    n = n + 1
    return true
  end
  return false
end

-- 1. Leases that lapsed. A renewed one is looked at again when it could lapse next.
for _, id in ipairs(redis.call('ZRANGEBYSCORE', running, '-inf', now, 'LIMIT', 0, page)) do
  local left = redis.call('PTTL', prefix .. id)
  if left > 0 then
    redis.call('ZADD', running, now + left, id)
    redis.call('ZREM', queue_waiting_key(q), id) -- its attempt took its lapsed lease back
  elseif left == -1 then
    redis.call('ZADD', running, now + ttl, id)
  else
    local score = redis.call('ZSCORE', q, id)
    if not score then
      redis.call('ZREM', running, id) -- finished or cancelled
      redis.call('ZREM', queue_waiting_key(q), id)
    elseif tonumber(score) > now then
      redis.call('ZADD', running, score, id) -- arq's Retry deferred it
    elseif n < wanted and may_run(id) and take(id, score) then
      redis.call('ZREM', queue_waiting_key(q), id)
    else -- it stays due, and the next claim (of a worker that may run it) takes it first
      redis.call('ZADD', queue_waiting_key(q), 'NX', now, id)
    end
  end
end

-- 2. Deferred jobs that are due join the index, scored by their run-at time; jobs held for
-- a worker whose window passed (their window's end is their score there) join it at their
-- place.
local deferred = q .. ':deferred'
local due = redis.call('ZRANGEBYSCORE', deferred, '-inf', now, 'WITHSCORES', 'LIMIT', 0, page)
for i = 1, #due, 2 do
  local id, at = due[i], due[i + 1]
  redis.call('ZREM', deferred, id)
  local meta = redis.call('HGET', indexed, id)
  local held_for = redis.call('HGET', held, id)
  if held_for then
    redis.call('HDEL', held, id)
    if meta then
      local band, tenant = string.match(meta, '^(%S+) (%S+)')
      local mine = q .. ':affine:' .. held_for .. ':' .. band
      if redis.call('ZREM', mine, id) == 1 then
        local score = redis.call('ZSCORE', waiting_key(q, band), id)
        if not (score and hold_for_eligible(id, band, score)) then
          reindex(id, band, tenant, score)
        end
        claimed[4] = claimed[4] + 1
        if redis.call('EXISTS', mine) == 0 then -- a dead worker leaves nothing behind
          redis.call('ZREM', q .. ':affine-bands:' .. held_for, band)
        end
      end
    end
  elseif meta then
    local prio, tenant = string.match(meta, '^(%S+) (%S+)')
    local score = redis.call('ZSCORE', waiting_key(q, prio), id) -- a job no eligible worker was live for
    if not score then
      score = at + (redis.call('INCR', q .. ':seq') % 1000) / 1000
      redis.call('ZADD', waiting_key(q, prio), score, id)
      redis.call('ZADD', queue_waiting_key(q), score, id)
    end
    if not hold_for_eligible(id, prio, score) then
      reindex(id, prio, tenant, score)
    end
  end
end

-- A pick charged to its tenant's pass in its band (1/weight), from at least the band's time.
local function charge(band, tenant, pass)
  local weight = tonumber(redis.call('HGET', weights, tenant))
  if not weight or weight <= 0 then weight = 1 end
  redis.call('ZADD', q .. ':tenants:' .. band, pass + 1 / weight, tenant)
end

-- The index: the most urgent band; in it, the jobs held for this worker, then the tenant
-- of lowest pass, that tenant's oldest job; until the claim has `limit` jobs.
local function from_index(limit)
  while n < limit do
    local band = redis.call('ZRANGE', bands, 0, 0)[1]
    local mine = redis.call('ZRANGE', my_bands, 0, 0)[1]
    if mine and (not band or tonumber(mine) <= tonumber(band)) then
      local head = redis.call('ZPOPMIN', q .. ':affine:' .. me .. ':' .. mine)
      if #head == 0 then
        redis.call('ZREM', my_bands, mine)
      else
        local id = head[1]
        redis.call('ZREM', q .. ':deferred', id)
        redis.call('HDEL', held, id)
        redis.call('ZREM', waiting_key(q, mine), id)
        redis.call('ZREM', queue_waiting_key(q), id)
        local meta = redis.call('HGET', indexed, id)
        redis.call('HDEL', indexed, id)
        if meta then
          local tenant = string.match(meta, '^%S+ (%S+)')
          local pass = redis.call('ZSCORE', q .. ':tenants:' .. mine, tenant)
          if pass then
            charge(mine, tenant, math.max(tonumber(pass), tonumber(redis.call('HGET', vtimes, mine) or 0)))
          end
        end
        local score = redis.call('ZSCORE', q, id)
        if score and take(id, score) then
          become_affinity_worker(meta)
          if meta and string.match(meta, ' steered$') then -- held for balance: a miss
            claimed[3] = claimed[3] + 1
          else
            claimed[2] = claimed[2] + 1
          end
        end
      end
    elseif not band then
      break
    else
      local tenants = q .. ':tenants:' .. band
      local top = redis.call('ZRANGE', tenants, 0, 0, 'WITHSCORES')
      if #top == 0 then
        redis.call('ZREM', bands, band)
        redis.call('HDEL', vtimes, band)
      else
        local tenant = top[1]
        local fifo = q .. ':fifo:' .. band .. ':' .. tenant
        local head = redis.call('ZPOPMIN', fifo)
        if #head == 0 then
          redis.call('ZREM', tenants, tenant)
        else
          local id = head[1]
          local pass = math.max(tonumber(top[2]), tonumber(redis.call('HGET', vtimes, band) or 0))
          redis.call('ZREM', waiting_key(q, band), id)
          redis.call('ZREM', queue_waiting_key(q), id)
          local meta = redis.call('HGET', indexed, id)
          redis.call('HDEL', indexed, id)
          if redis.call('EXISTS', fifo) == 1 then
            charge(band, tenant, pass)
          else
            redis.call('ZREM', tenants, tenant)
          end
          redis.call('HSET', vtimes, band, pass)
          local score = redis.call('ZSCORE', q, id)
          if score and take(id, score) and become_affinity_worker(meta) then -- gone: cancelled or expired outside the scripts
            claimed[3] = claimed[3] + 1
          end
        end
      end
    end
  end
end
from_index(wanted)

-- Whether the scan below may take a due job: one nobody indexed, or one indexed where no
-- claim would reach it any more (an evicting Redis deleted its place in the index: its band,
-- its tenant in the band or its entry in the tenant's queue, or the window it was held for):
-- its index entry is dropped, and it is taken like a bare ZADD.
local function unindexed(id)
  local meta = redis.call('HGET', indexed, id)
  if not meta then return true end
  if redis.call('ZSCORE', q .. ':deferred', id) then return false end -- held, or not due yet
  local band, tenant = string.match(meta, '^(%S+) (%S+)')
  local fifo = q .. ':fifo:' .. band .. ':' .. tenant
  if redis.call('ZSCORE', fifo, id) and redis.call('ZSCORE', bands, band)
      and redis.call('ZSCORE', q .. ':tenants:' .. band, tenant) then
    return false
  end
  if not may_run(id) then return false end
  redis.call('HDEL', indexed, id)
  redis.call('ZREM', fifo, id)
  redis.call('ZREM', waiting_key(q, band), id)
  return true
end

-- 3. arq's queue itself (due jobs nobody indexed: a bare ZADD; or no longer reached through
--    the index), when slots remain and nobody scanned lately.
if n < wanted and redis.call('SET', q .. ':scan', now, 'NX', 'PX', scan_ms) then
  local offset = 0
  while n < wanted do
    local page_due = redis.call('ZRANGEBYSCORE', q, '-inf', now, 'WITHSCORES', 'LIMIT', offset, page)
    if #page_due == 0 then break end
    for i = 1, #page_due, 2 do
      if unindexed(page_due[i]) and take(page_due[i], page_due[i + 1]) then
        redis.call('ZREM', queue_waiting_key(q), page_due[i]) -- a lapsed lease step 1 did not reach
        if n >= wanted then break end
      end
    end
    offset = offset + page
  end
end
-- 4. With its slots filled, up to `ahead` more jobs from the index, to wait in this worker's
-- engine and start in the step a slot frees: only as many as the waiting jobs exceed the
-- free slots of the other live workers (a worker whose free slots lapsed is dropped), so
-- that no job waits in one engine while another worker has room for it.
if ahead > 0 and n >= wanted then
  local waiting = redis.call('ZCARD', queue_waiting_key(q))
  if waiting > 0 then
    local room = 0
    for _, worker in ipairs(redis.call('ZRANGE', q .. ':load', 0, -1)) do
      if worker ~= me then
        local free = redis.call('GET', affinity_free_key(q, worker))
        if free then
          room = room + math.max(0, tonumber(free))
        else
          redis.call('ZREM', q .. ':load', worker)
        end
      end
    end
    if waiting > room then
      from_index(n + math.min(ahead, waiting - room))
    end
  end
end
-- Jobs held for another worker, or moved into the index and maybe left there (this claim
-- filled its slots): the others claim now rather than at their next poll.
if wakeup ~= '' and (held_for_others or (promoted and n >= wanted)) then
  redis.call('PUBLISH', wakeup, q)
end
-- What enqueue reads to route a job here: this worker's free slots (lapsing unless it
-- claims again; the jobs taken for its engine's queue fill its spare slots first) and how
-- many jobs it runs.
if free_ttl > 0 then
  redis.call('SET', affinity_free_key(q, me), math.max(0, wanted + spare - n), 'PX', free_ttl)
  redis.call('ZADD', q .. ':load', busy + n, me)
end
return claimed
