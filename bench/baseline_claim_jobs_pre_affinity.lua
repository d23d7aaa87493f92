-- A verbatim copy of streamq/protocol/lua/claim_jobs.lua as of commit dc792b7 (before
-- prefix-aware pickup): bench/claim.py measures what affinity adds to each claim against it.
-- KEYS[1]: the queue. ARGV: how many to claim, in-progress TTL (ms), queue entries to
-- read per page, the in-progress key prefix, this worker's id (the lease's holder), the
-- tenant weights hash (only read), the minimum ms between two scans of the whole queue.
-- Returns Redis's time (ms), then id, score, id, score, ... of the jobs claimed (score:
-- the job's score in the queue). Jobs are due by Redis's clock, never a worker's.
--
-- arq's queue stays the source of truth (a job is queued or running while it is in it);
-- the claim takes, in this order, until it has enough:
-- 1. claimed jobs whose lease lapsed (their worker died or handed them back) or whose
--    arq Retry is due, from <queue>:running (id -> when to look at it again): a taken-over
--    request has a subscriber waiting mid-stream;
-- 2. the index of waiting jobs, after promoting due ones from <queue>:deferred: the
--    lowest priority band first; in a band, the tenant with the lowest pass (stride
--    scheduling: a pick adds 1/weight; a tenant starts at the band's virtual time, the
--    pass of the band's last pick, so an idle tenant banks no credit); FIFO in a tenant;
-- 3. at most once per scan interval (all workers together), arq's queue itself, in score
--    order, for due jobs nobody indexed (a bare ZADD) or claimed through this script.
local q = KEYS[1]
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local wanted, ttl, page, prefix, me = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], ARGV[5]
local weights, scan_ms = ARGV[6] or 'streamq:tenant-weights', ARGV[7] or '1000'
local running, indexed, bands, vtimes = q .. ':running', q .. ':indexed', q .. ':bands', q .. ':vtime'
local claimed, n = {now}, 0

local function take(id, score)
  if redis.call('SET', prefix .. id, me, 'NX', 'PX', ttl) then
    redis.call('ZADD', running, now + ttl, id)
    claimed[#claimed + 1] = id
    claimed[#claimed + 1] = score
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
  elseif left == -1 then
    redis.call('ZADD', running, now + ttl, id)
  else
    local score = redis.call('ZSCORE', q, id)
    if not score then
      redis.call('ZREM', running, id) -- finished or cancelled
    elseif tonumber(score) > now then
      redis.call('ZADD', running, score, id) -- arq's Retry deferred it
    elseif n < wanted then
      take(id, score)
    end -- else it stays due, and the next claim takes it first
  end
end

-- 2. Deferred jobs that are due join the index, scored by their run-at time.
local deferred = q .. ':deferred'
local due = redis.call('ZRANGEBYSCORE', deferred, '-inf', now, 'WITHSCORES', 'LIMIT', 0, page)
for i = 1, #due, 2 do
  local id, at = due[i], due[i + 1]
  redis.call('ZREM', deferred, id)
  local meta = redis.call('HGET', indexed, id)
  if meta then
    local prio, tenant = string.match(meta, '^(%S+) (%S+)$')
    local score = at + (redis.call('INCR', q .. ':seq') % 1000) / 1000
    redis.call('ZADD', q .. ':waiting:' .. prio, score, id)
    redis.call('ZADD', q .. ':fifo:' .. prio .. ':' .. tenant, score, id)
    redis.call('ZADD', q .. ':tenants:' .. prio, 'NX', 0, tenant)
    redis.call('ZADD', bands, prio, prio)
  end
end

-- The index: the most urgent band, its tenant of lowest pass, that tenant's oldest job.
while n < wanted do
  local band = redis.call('ZRANGE', bands, 0, 0)[1]
  if not band then break end
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
      redis.call('ZREM', q .. ':waiting:' .. band, id)
      redis.call('HDEL', indexed, id)
      if redis.call('EXISTS', fifo) == 1 then
        local weight = tonumber(redis.call('HGET', weights, tenant))
        if not weight or weight <= 0 then weight = 1 end
        redis.call('ZADD', tenants, pass + 1 / weight, tenant)
      else
        redis.call('ZREM', tenants, tenant)
      end
      redis.call('HSET', vtimes, band, pass)
      local score = redis.call('ZSCORE', q, id)
      if score then take(id, score) end -- gone: cancelled or expired outside the scripts
    end
  end
end

-- 3. arq's queue, as before the index, when slots remain and nobody scanned lately.
if n < wanted and redis.call('SET', q .. ':scan', now, 'NX', 'PX', scan_ms) then
  local offset = 0
  while n < wanted do
    local page_due = redis.call('ZRANGEBYSCORE', q, '-inf', now, 'WITHSCORES', 'LIMIT', offset, page)
    if #page_due == 0 then break end
    for i = 1, #page_due, 2 do
      if redis.call('HEXISTS', indexed, page_due[i]) == 0 and take(page_due[i], page_due[i + 1]) and n >= wanted then
        break
      end
    end
    offset = offset + page
  end
end
return claimed
